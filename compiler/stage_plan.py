"""Decide how many transformer blocks each pipeline stage holds, from per-layer costs."""

from __future__ import annotations

from dataclasses import dataclass

from compiler.cost import layer_costs
from compiler.partition import layer_split, parse_split, rank_costs, stage_costs_with_ends


@dataclass(frozen=True)
class StagePlan:
    blocks_per_stage: list[int]
    stage_costs: list[float]  # per stage, one micro-batch forward + backward
    unit: str  # "GFLOP" or "ms"
    method: str
    placement: str = "loop"  # compiler/partition.py's placement_stages: which stages each pp rank holds

    @property
    def n_stages(self) -> int:
        return len(self.blocks_per_stage)

    @property
    def imbalance(self) -> float:
        """max / mean stage cost: 1.0 is perfect balance."""
        return max(self.stage_costs) / (sum(self.stage_costs) / len(self.stage_costs))

    def describe(self) -> str:
        lines = [f"stage split ({self.method}): blocks per stage {self.blocks_per_stage}, "
                 f"imbalance max/mean = {self.imbalance:.3f}"]
        first = 0
        for s, (n, cost) in enumerate(zip(self.blocks_per_stage, self.stage_costs)):
            parts = (["embedding"] if s == 0 else []) + ([f"blocks {first}..{first + n - 1}"] if n else [])
            parts += ["norm/head"] if s == len(self.blocks_per_stage) - 1 else []
            lines.append(f"  stage {s}: {' + '.join(parts)}  est. {cost:.3f} {self.unit}/micro-batch")
            first += n
        if self.placement == "v":
            pp = self.n_stages // 2
            lines.append("  V placement, per pp rank (stages r and 2p-1-r): " + ", ".join(
                f"{r}: {c:.3f}" for r, c in enumerate(rank_costs(self.stage_costs, "v", pp=pp))) + f" {self.unit}")
        return "\n".join(lines)


def plan_stages(cfg, *, n_stages: int, micro_batch_size: int, split: str, precision: str = "fp32",
                mp: int = 1, layer_seconds: list[float] | None = None, placement: str = "loop") -> StagePlan:
    """Blocks per stage for ``--split``. ``auto`` balances counted FLOPs, or ``layer_seconds`` (measured
    forward + backward of [embedding, block 0, ..., block L-1, norm + head]) when given."""
    if layer_seconds is not None:
        costs, unit = [t * 1e3 for t in layer_seconds], "ms"
    else:
        layers = layer_costs(cfg, micro_batch_size=micro_batch_size, precision=precision, mp=mp)
        costs, unit = [c.flops / 1e9 for c in layers], "GFLOP"
    sizes = parse_split(split, n_stages=n_stages, n_layers=cfg.n_layers)
    method = split
    if sizes is None:
        sizes = layer_split(costs, n_stages, placement=placement)
        target = "the busiest rank's pair of stages" if placement == "v" else "the busiest stage"
        method = (f"auto: exact min-max of {target} over "
                  f"{'measured times' if layer_seconds is not None else 'counted FLOPs'}")
    return StagePlan(sizes, stage_costs_with_ends(costs, sizes), unit, method, placement)
