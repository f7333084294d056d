"""Enumerate every plan for a world size, predict its memory and step time, rank the feasible ones."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from compiler.cost import LayerCost, head_loss_bytes, layer_costs
from compiler.flops import training_flops_per_token
from compiler.partition import layer_split
from compiler.planner.candidates import Candidate, candidates
from compiler.planner.cluster import Cluster
from compiler.planner.memory_model import DataParallelLayout, rank_memory
from compiler.planner.time_model import StepTerms, TimeEstimate, step_time
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES

# A plan -> the one-line error the engine would print for it, or None if it would run it.
Validator = Callable[[Candidate], "str | None"]


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    feasible: bool
    reason: str | None
    step_time: float | None = None
    tokens_per_sec: float | None = None
    mfu: float | None = None
    memory_per_rank: float | None = None
    breakdown: TimeEstimate | None = None
    blocks_per_stage: tuple[int, ...] | None = None
    terms: StepTerms | None = None  # unscaled terms of the step time (what calibration fits)

    def to_dict(self) -> dict:
        return {"plan": self.candidate.to_dict(), "describe": self.candidate.describe(), "feasible": self.feasible,
                "reason": self.reason, "step_time_s": self.step_time, "tokens_per_sec": self.tokens_per_sec,
                "mfu": self.mfu, "memory_per_rank_bytes": self.memory_per_rank,
                "blocks_per_stage": list(self.blocks_per_stage or []),
                "breakdown": vars(self.breakdown) if self.breakdown else None}


class CostTable:
    """Layer costs per (precision, mp) at micro-batch 1; FLOPs and activations scale linearly with it, the
    loss's backward transient does not (its fp32 chunks are bounded: compiler/cost.py ``head_loss_bytes``)."""

    def __init__(self, cfg, count: Callable[..., list[LayerCost]] = layer_costs):
        """``count``: compiler/cost.py's ``layer_costs`` (counted on the model), or a function with its
        signature (compiler/planner/shape.py's closed forms, equal on GPT shapes, no tracing)."""
        self.cfg, self._count, self._cache, self._splits = cfg, count, {}, {}

    def split(self, precision: str, mp: int, n_stages: int, placement: str = "loop") -> list[int]:
        """The FLOP-balanced split; costs scale with the micro-batch, so the split does not depend on it."""
        key = (precision, mp, n_stages, placement)
        if key not in self._splits:
            self._splits[key] = layer_split([c.flops for c in self.layers(precision, mp, 1)], n_stages,
                                            placement=placement)
        return self._splits[key]

    def layers(self, precision: str, mp: int, micro_batch_size: int) -> list[LayerCost]:
        key = (precision, mp)
        if key not in self._cache:
            self._cache[key] = self._count(self.cfg, micro_batch_size=1, precision=precision, mp=mp)
        _, loss_transient = head_loss_bytes(micro_batch_size * self.cfg.seq_len,
                                            vocab_rows=-(-self.cfg.vocab_size // mp), precision=precision)
        return [replace(c, flops=c.flops * micro_batch_size, activation_bytes=c.activation_bytes * micro_batch_size,
                        selective_activation_bytes=c.selective_activation_bytes * micro_batch_size,
                        selective_recompute_bytes=c.selective_recompute_bytes * micro_batch_size,
                        transient_bytes=loss_transient if c.transient_bytes else 0) for c in self._cache[key]]


def estimate(c: Candidate, *, cfg, cluster: Cluster, costs: CostTable, validate: Validator,
             model_flops_per_token: float) -> Estimate:
    world = c.dp * c.pp * c.mp
    error = validate(c)
    if error:
        return Estimate(c, False, error)
    sizes = costs.split(c.precision, c.mp, c.pp * c.stages_per_rank, SCHEDULES[c.schedule].placement)
    ranks_per_node = min(cluster.ranks_per_node, world)
    budget = cluster.memory_per_rank(ranks_per_node)
    per_rank, peaks = rank_layers_and_memory(c, cfg=cfg, costs=costs)
    memory = max(peaks)
    if memory > budget:
        return Estimate(c, False, f"out of memory: needs {memory / 2**30:.2f} GiB per rank, has {budget / 2**30:.2f} GiB",
                        memory_per_rank=memory, blocks_per_stage=tuple(sizes))
    busiest = max(per_rank, key=lambda mine: sum(x.flops for x in mine))
    t, terms = step_time(c, rank_flops=sum(x.flops for x in busiest), rank_layers=len(busiest),
                         rank_params=sum(x.params for x in busiest), seq_len=cfg.seq_len, d_model=cfg.d_model,
                         cluster=cluster)
    tokens = c.dp * c.microbatches * c.micro_batch_size * cfg.seq_len / t.step
    units = min(world, cluster.nodes * cluster.compute_units_per_node)
    peak = cluster.notes.get("peak_flops", {}).get(c.precision, cluster.flops[c.precision])
    mfu = tokens * model_flops_per_token / (units * peak)
    return Estimate(c, True, None, t.step, tokens, mfu, memory, t, tuple(sizes), terms)


def rank_layers_and_memory(c: Candidate, *, cfg, costs: CostTable) -> tuple[list[list[LayerCost]], list[float]]:
    """Per pp rank: the layers it holds (its v stages, per mp shard) and its predicted peak tensor bytes."""
    layers = costs.layers(c.precision, c.mp, c.micro_batch_size)
    spec = SCHEDULES[c.schedule]
    stage_layers = _stage_layers(layers, costs.split(c.precision, c.mp, c.pp * c.stages_per_rank, spec.placement))
    dtype = PRECISIONS[c.precision].autocast_dtype
    layout = DataParallelLayout(c.dp, c.shard, c.reshard_after_forward, dtype.itemsize if dtype else 4)
    per_rank, peaks = [], []
    for r in range(c.pp):
        held = sorted(spec.stage_indices(r, pp=c.pp, stages_per_rank=c.stages_per_rank))
        mine = [layer for s in held for layer in stage_layers[s]]
        if cfg.tie_embeddings and mine[0].name == "embedding" and mine[-1].name == "head":
            mine[-1] = replace(mine[-1], params=mine[-1].params - mine[0].params + _position_params(cfg, c.mp))
        mem = rank_memory(mine, schedule=c.schedule, p=c.pp, m=c.microbatches, v=c.stages_per_rank, layout=layout, rank=r,
                          activation_checkpointing=c.activation_checkpointing, micro_batch_size=c.micro_batch_size,
                          seq_len=cfg.seq_len, d_model=cfg.d_model, mp=c.mp,
                          sequence_parallel=c.sequence_parallel,
                          activation_itemsize=layout.gather_bytes if layout.fsdp else 4,
                          selective_checkpointing=c.selective_checkpointing)
        per_rank.append(mine)
        peaks.append(mem.total)
    return per_rank, peaks


def _position_params(cfg, mp: int) -> int:
    """The embedding layer's parameters that are not the token table (the position embedding)."""
    return cfg.seq_len * cfg.d_model


def _stage_layers(layers: list[LayerCost], sizes: list[int]) -> list[list[LayerCost]]:
    blocks = layers[1:-1]
    out, start = [], 0
    for s, n in enumerate(sizes):
        stage = blocks[start:start + n]
        if s == 0:
            stage = [layers[0], *stage]
        if s == len(sizes) - 1:
            stage = [*stage, layers[-1]]
        out.append(stage)
        start += n
    return out


def plan(cfg, *, world: int, global_batch_size: int, cluster: Cluster, validate: Validator,
         precisions: tuple[str, ...] = ("fp32", "bf16", "fp16"),
         activation_checkpointing: tuple[bool, ...] = (False, True)) -> list[Estimate]:
    """Every candidate with its estimate: feasible ones first, fastest first."""
    costs = CostTable(cfg)
    flops_per_token = training_flops_per_token(cfg)
    estimates = [estimate(c, cfg=cfg, cluster=cluster, costs=costs, validate=validate,
                          model_flops_per_token=flops_per_token)
                 for c in candidates(world, global_batch_size=global_batch_size, precisions=precisions,
                                     activation_checkpointing=activation_checkpointing)]
    return sorted(estimates, key=lambda e: (not e.feasible, e.step_time if e.feasible else 0.0))
