"""Decide how many transformer blocks each pipeline stage holds, from a per-layer cost estimate."""

from __future__ import annotations

from dataclasses import dataclass

from compiler.cost import block_costs_with_ends, layer_costs
from compiler.partition import balanced_split, parse_split, stage_costs
from models.gpt import GPTConfig


@dataclass(frozen=True)
class StagePlan:
    blocks_per_stage: list[int]
    stage_flops: list[float]  # estimated forward+backward FLOPs of one micro-batch, per stage
    method: str

    @property
    def imbalance(self) -> float:
        """max / mean stage cost: 1.0 is perfect balance."""
        return max(self.stage_flops) / (sum(self.stage_flops) / len(self.stage_flops))

    def describe(self) -> str:
        lines = [f"stage split ({self.method}): blocks per stage {self.blocks_per_stage}, "
                 f"imbalance max/mean = {self.imbalance:.3f}"]
        first = 0
        for s, (n, flops) in enumerate(zip(self.blocks_per_stage, self.stage_flops)):
            extra = (" + embedding" if s == 0 else "") + (" + norm/head" if s == len(self.blocks_per_stage) - 1 else "")
            lines.append(f"  stage {s}: layers {first}..{first + n - 1}{extra}  est. {flops / 1e9:.3f} GFLOP/micro-batch")
            first += n
        return "\n".join(lines)


def plan_stages(cfg: GPTConfig, *, n_stages: int, micro_batch_size: int, split: str) -> StagePlan:
    costs = block_costs_with_ends(layer_costs(cfg, micro_batch_size=micro_batch_size))
    sizes = parse_split(split, n_stages=n_stages, n_layers=cfg.n_layers)
    method = split
    if sizes is None:
        sizes, method = balanced_split(costs, n_stages), "auto: min-max over estimated FLOPs"
    return StagePlan(sizes, stage_costs(costs, sizes), method)
