"""Search every plan of a decoder shape on a GPU cluster, up to tens of thousands of GPUs, in seconds.

The plan space: every (dp, pp, mp) of the world with mp inside a node (unless ``max_mp`` allows more)
and dp dividing the global batch; every schedule of the registry but naive, with v from the schedule
(looped schedules: 2 to 8 stages per rank while the layers last); every micro-batch size dividing a
replica's batch; activation checkpointing on and off; the DP modes FSDP, ZeRO-3, replicate and HSDP
(sharded within a node, or over powers of two). Every plan gets the engine's pipeline rules and, when
given, the engine's own validation.

Pruning keeps the answer exact: layer times depend only on (mesh, micro-batch, AC, precision), and a
group of plans sharing them has a lower bound (its average rank's compute and TP time, no bubble); the
groups are priced in order of their bounds until a bound reaches the best plan found. Within a group,
a (schedule, v) whose leanest DP mode does not fit is not tried in the others. Memory is that of the
fullest pp rank (compiler/planner/memory_model.py, the engine's model, from the analytic layer costs).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from compiler.planner.candidates import Candidate, Constraints, dp_mode, meshes
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.gpu_step import LayerTable, StepBreakdown, layer_table, rank_work, step_breakdown
from compiler.planner.gpu_time import EngineTraits
from compiler.planner.memory_model import DataParallelLayout, HeldLayers, rank_memory
from compiler.planner.shape import (
    DecoderShape,
    analytic_layer_costs,
    block_params,
    embedding_params,
    hardware_flops_per_token,
    head_params,
    model_flops_per_token,
)
from compiler.planner.split import min_max_split
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES

MAX_LOOPED_V = 8


@dataclass(frozen=True)
class GpuEstimate:
    candidate: Candidate
    step_time: float
    breakdown: StepBreakdown
    memory_bytes: float
    fits: bool
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float

    @property
    def memory_per_rank(self) -> float:
        return self.memory_bytes

    def to_json(self) -> dict:
        """The PLAN object of ``run.py plan --json``."""
        c = self.candidate
        return {"dp": c.dp, "pp": c.pp, "mp": c.mp, "schedule": c.schedule, "stages_per_rank": c.stages_per_rank,
                "micro_batch_size": c.micro_batch_size, "activation_checkpointing": c.activation_checkpointing,
                "dp_mode": dp_mode(c), "step_time_s": self.step_time,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "memory_gib_per_gpu": self.memory_bytes / 2**30, "fits": self.fits,
                "breakdown": {"compute": self.breakdown.compute, "bubble": self.breakdown.bubble,
                              "tp": self.breakdown.tp, "pp": self.breakdown.pp,
                              "dp_exposed": self.breakdown.dp_exposed, "optimizer": self.breakdown.optimizer}}


@dataclass(frozen=True)
class SearchResult:
    top: list[GpuEstimate]  # the fastest plans (that fit, unless the search was asked to ignore memory), fastest first
    considered: int  # plans in the space (those skipped by the bound included)
    priced: int  # plans whose step time was computed
    infeasible: Counter  # reason -> plans

    @property
    def best(self) -> GpuEstimate | None:
        return self.top[0] if self.top else None

    def reasons(self) -> str:
        return ", ".join(f"{n} x {r}" for r, n in self.infeasible.most_common()) or "none"


def schedule_choices(pp: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name, spec in SCHEDULES.items():
        if not spec.planner_v:
            continue  # naive: never planned
        vs = [spec.fixed_v] if spec.fixed_v else range(2, MAX_LOOPED_V + 1)
        out += [(name, v) for v in vs if pp * v <= layers]
    return out


def structural_error(c: Candidate, layers: int) -> str | None:
    """The engine's pipeline rules (runtime/config.py) that depend on the plan alone."""
    spec = SCHEDULES[c.schedule]
    if c.pp * c.stages_per_rank > layers:
        return "too few layers for pp x v stages"
    if c.microbatches < spec.min_microbatches_per_pp * c.pp:
        return "too few micro-batches for the schedule"
    if spec.microbatches_multiple_of_pp and c.microbatches % c.pp:
        return "micro-batches not a multiple of pp"
    return None


def dp_modes(dp: int, *, per_node: int) -> list[tuple[int | None, bool]]:
    """(dp_shard, reshard_after_forward): FSDP, ZeRO-3, replicate, HSDP over a node's members or powers of two."""
    if dp == 1:
        return [(None, False)]
    shards = {s for s in (per_node, *(2 ** i for i in range(1, 9))) if 1 < s < dp and dp % s == 0}
    return [(None, False), (None, True), (1, False), *((s, False) for s in sorted(shards))]


class _Shape:
    """Per-shape caches: layer times, analytic layer costs, splits."""

    def __init__(self, shape: DecoderShape, cluster: GpuCluster, traits: EngineTraits):
        self.shape, self.cluster, self.traits = shape, cluster, traits
        self.table = lru_cache(maxsize=None)(self._table)
        self.costs = lru_cache(maxsize=None)(self._costs)
        self.split = lru_cache(maxsize=None)(self._split)
        self.ranks = lru_cache(maxsize=None)(lambda schedule, pp, v: _rank_layers(schedule, pp, v, self.split(pp * v)))
        self.params = lru_cache(maxsize=None)(lambda mp: dict(
            block_params=block_params(shape, mp), embedding_params=embedding_params(shape, mp),
            head_params=head_params(shape, mp)))

    def _table(self, mp: int, mbs: int, precision: str, ac: bool) -> LayerTable:
        return layer_table(self.shape, self.cluster, self.traits, micro_batch_size=mbs, mp=mp, precision=precision,
                           activation_checkpointing=ac)

    def _costs(self, mp: int, mbs: int, precision: str):
        costs = analytic_layer_costs(self.shape, micro_batch_size=mbs, precision=precision, mp=mp)
        if self.traits.attention == "materialized":
            # Without FlashAttention each block also keeps its T x T scores: the softmax output and the
            # dropout output (compute dtype) and the dropout mask (a byte), Korthikanti et al. 2022's 5 a s^2 b.
            scores = (2 * PRECISIONS[precision].dtype.itemsize + 1) * mbs * (self.shape.heads // mp) * self.shape.seq_len ** 2
            costs = [costs[0], *(replace(c, activation_bytes=c.activation_bytes + scores) for c in costs[1:-1]), costs[-1]]
        return costs

    def _split(self, n_stages: int) -> tuple[int, ...]:
        """Blocks per stage balancing FLOPs (the engine's --split auto; FLOP ratios do not depend on mp or
        the micro-batch)."""
        costs = [c.flops for c in self._costs(1, 1, "bf16")]
        items = min_max_split(costs, n_stages)
        return tuple([items[0] - 1, *items[1:-1], items[-1] - 1] if n_stages > 1 else [items[0] - 2])


def _MODE_ORDER(shard: int | None, zero3: bool, dp: int) -> int:
    """DP modes from the least memory up: ZeRO-3 (or no DP), FSDP, HSDP by shard size, replicate. A plan
    that does not fit in the first does not fit in any."""
    if dp == 1 or zero3:
        return 0
    return 1 if shard is None else 2 + dp - shard


def _bubble(c: Candidate) -> float:
    spec = SCHEDULES[c.schedule]
    return 0.0 if c.pp == 1 else (spec.planned_bubble or spec.bubble)(c.pp, c.microbatches, c.stages_per_rank)


def _rank_layers(schedule: str, pp: int, v: int, blocks: tuple[int, ...]) -> dict[tuple[int, bool, bool], int]:
    """(blocks, holds the embedding, holds the head) -> the first pp rank holding that much under the
    schedule's placement. Ranks alike cost alike, and the first of them holds the most micro-batches in
    flight (every schedule's count falls or stays with the rank, compiler/schedules.py)."""
    spec = SCHEDULES[schedule]
    out: dict[tuple[int, bool, bool], int] = {}
    for r in range(pp):
        held = spec.stage_indices(r, pp=pp, stages_per_rank=v)
        out.setdefault((sum(blocks[i] for i in held), 0 in held, len(blocks) - 1 in held), r)
    return out


def _held(s: _Shape, c: Candidate, n_blocks: int, embedding: bool, head: bool) -> HeldLayers:
    """compiler/planner/memory_model.HeldLayers of a rank, from counts (all blocks cost alike)."""
    costs = s.costs(c.mp, c.micro_batch_size, c.precision)
    parts = [(costs[1], n_blocks)] + [(costs[0], 1)] * embedding + [(costs[-1], 1)] * head
    parts = [(x, n) for x, n in parts if n]
    params = sum(x.params * n for x, n in parts)
    if s.shape.tied and embedding and head:  # one copy of a tied weight on a rank holding both ends
        params -= costs[0].params - (s.shape.position_rows * s.shape.d_model if s.shape.positions == "learned" else 0)
    return HeldLayers(params, max(x.params for x, _ in parts), sum(x.activation_bytes * n for x, n in parts),
                      max(x.activation_bytes for x, _ in parts), sum(x.weight_copy_bytes * n for x, n in parts),
                      sum(n for _, n in parts), n_blocks, max(x.transient_bytes for x, _ in parts))


def _memory(c: Candidate, s: _Shape, ranks: dict[tuple[int, bool, bool], int]) -> float:
    """The largest memory of any pp rank (compiler/planner/memory_model.py)."""
    dtype = PRECISIONS[c.precision].autocast_dtype
    layout = DataParallelLayout(c.dp, c.shard, c.reshard_after_forward, dtype.itemsize if dtype else 4)
    sp = s.traits.sequence_parallel and c.mp > 1
    return max(rank_memory(_held(s, c, *rank), schedule=c.schedule, p=c.pp, m=c.microbatches, v=c.stages_per_rank,
                           layout=layout, rank=r, activation_checkpointing=c.activation_checkpointing,
                           micro_batch_size=c.micro_batch_size, seq_len=s.shape.seq_len, d_model=s.shape.d_model,
                           mp=c.mp, input_shards=c.mp if sp else 1).total
               for rank, r in ranks.items())


def _estimate(c: Candidate, s: _Shape, *, world: int, tokens: int, memory: float | None = None) -> GpuEstimate:
    ranks = s.ranks(c.schedule, c.pp, c.stages_per_rank)
    table = s.table(c.mp, c.micro_batch_size, c.precision, c.activation_checkpointing)
    busiest = max((rank_work(table, *rank, **s.params(c.mp)) for rank in ranks),
                  key=lambda w: w.forward + w.backward + w.tp)
    shards = c.shard if c.shard > 1 and c.dp > 1 else 1
    breakdown = step_breakdown(c, s.cluster, s.traits, s.shape, busiest=busiest, optimizer_params=busiest.params / shards)
    memory = _memory(c, s, ranks) if memory is None else memory
    step = breakdown.step
    model = model_flops_per_token(s.shape) * tokens / step / world
    hardware = hardware_flops_per_token(s.shape, activation_checkpointing=c.activation_checkpointing) * tokens / step / world
    return GpuEstimate(c, step, breakdown, memory, memory <= s.cluster.memory_bytes, model / 1e12, hardware / 1e12,
                       model / s.cluster.peak_flops[c.precision])


def search(shape: DecoderShape, *, world: int, global_batch_size: int, cluster: GpuCluster,
           traits: EngineTraits = EngineTraits(), precisions: tuple[str, ...] = ("bf16",),
           constraints: Constraints = Constraints(), max_mp: int | None = None,
           validate: Callable[[Candidate], str | None] | None = None, keep: int = 1,
           require_fit: bool = True) -> SearchResult:
    """The ``keep`` fastest plans that fit (all plans with ``require_fit=False``); ``validate`` adds the
    engine's own checks.

    Best-first branch and bound: plans are grouped by (mesh, micro-batch, AC, precision), which fixes
    their layer times; a group's bound is its busiest rank's least possible compute and TP time (the
    average rank's, with no bubble); groups are priced in order of their bounds until the next bound
    is no better than the best plan found."""
    s = _Shape(shape, cluster, traits)
    max_mp = max_mp or cluster.devices_per_node
    tokens = global_batch_size * shape.seq_len
    infeasible: Counter = Counter()
    groups = []  # (bound, mesh, micro-batch, AC, precision, [(schedule, v, shard, zero3)])
    considered = 0
    for dp, pp, mp in meshes(world):
        if any(want is not None and want != got for want, got in ((constraints.dp, dp), (constraints.pp, pp),
                                                                  (constraints.mp, mp))):
            continue
        reason = ("mp beyond a node" if mp > max_mp else "dp does not divide the batch" if global_batch_size % dp
                  else "too few layers" if pp > shape.layers
                  else "mp does not divide the heads or widths" if shape.shard_error(mp) else None)
        if reason:
            infeasible[reason] += 1
            continue
        per_replica = global_batch_size // dp
        choices = [(name, v, shard, zero3) for name, v in schedule_choices(pp, shape.layers)
                   for shard, zero3 in dp_modes(dp, per_node=max(1, cluster.devices_per_node // (pp * mp)))]
        for mbs in (b for b in range(1, per_replica + 1) if per_replica % b == 0):
            for ac in (False, True):
                for precision in precisions:
                    admitted = [x for x in choices if constraints.admits(
                        Candidate(dp, pp, mp, x[0], x[1], per_replica // mbs, mbs, precision, ac, x[2], x[3]))]
                    considered += len(admitted)
                    if admitted:
                        table = s.table(mp, mbs, precision, ac)
                        bound = (per_replica // mbs) * (table.block.forward + table.block.backward + table.block.tp) \
                            * shape.layers / pp
                        groups.append((bound, (dp, pp, mp), mbs, ac, precision, admitted))
    groups.sort(key=lambda g: g[0])
    top: list[GpuEstimate] = []
    priced = 0

    def cutoff() -> float:
        return top[-1].step_time if len(top) >= keep else float("inf")

    for bound, (dp, pp, mp), mbs, ac, precision, admitted in groups:
        if bound >= cutoff():
            break  # every later group is bounded higher still
        out_of_memory: set[tuple[str, int]] = set()  # (schedule, v) whose leanest DP mode does not fit
        for name, v, shard, zero3 in sorted(admitted, key=lambda x: _MODE_ORDER(x[2], x[3], dp)):
            c = Candidate(dp, pp, mp, name, v, global_batch_size // dp // mbs, mbs, precision, ac, dp_shard=shard,
                          reshard_after_forward=zero3)
            if (name, v) in out_of_memory:
                infeasible["out of memory"] += 1
                continue
            if bound / (1 - _bubble(c)) >= cutoff():
                continue
            error = structural_error(c, shape.layers) or (validate(c) if validate else None)
            if error:
                infeasible[error.split(";")[0]] += 1
                continue
            memory = _memory(c, s, s.ranks(c.schedule, c.pp, c.stages_per_rank))
            if memory > cluster.memory_bytes:
                infeasible["out of memory"] += 1
                if _MODE_ORDER(shard, zero3, dp) == 0 and require_fit:
                    out_of_memory.add((name, v))
                if require_fit:
                    continue
            e = _estimate(c, s, world=world, tokens=tokens, memory=memory)
            priced += 1
            if e.step_time < cutoff():
                top = sorted([*top, e], key=lambda x: x.step_time)[:keep]
    return SearchResult(top, considered, priced, infeasible)


def price(shape: DecoderShape, candidate: Candidate, *, world: int, cluster: GpuCluster,
          traits: EngineTraits = EngineTraits()) -> GpuEstimate:
    """One fully specified plan (fitting or not)."""
    tokens = candidate.dp * candidate.microbatches * candidate.micro_batch_size * shape.seq_len
    return _estimate(candidate, _Shape(shape, cluster, traits), world=world, tokens=tokens)
