"""A training step of one plan on a GPU cluster: the busiest pipeline rank's micro-batches stretched by
the schedule's bubble, pipeline messages, data-parallel collectives by mode with the part that
overlaps compute, and AdamW; memory per GPU by compiler/planner/memory_model.py (the engine's model).

    step = m (compute + TP + PP) / (1 - bubble) + DP exposed + optimizer

- The busiest rank is the one whose stages (compiler/schedules.py placements over a min-max split of
  the layers' FLOPs, as the engine splits) take longest per micro-batch.
- Pipeline messages: an activation forward and a gradient backward per stage micro-batch, [b, T, d]
  in the compute dtype (divided over the TP ranks with Megatron's scatter/gather or sequence
  parallelism), over NVLink when a pipeline fits in a node, else InfiniBand; waited for, not hidden.
- Data parallelism (ranks are laid out dp-major, so a dp group has k = devices_per_node / (pp mp)
  members per node): a collective spanning nodes runs at min(NVLink, k x NIC) per rank, since the
  node's k group members drive k NICs at once (NCCL runs a ring per NIC); within a node at NVLink. Ring
  bandwidth terms; latency grows with log2 of the group across nodes (NCCL's trees), linearly inside.
  Replicate: one all-reduce of the gradients, hidden behind the last micro-batch's backward where the
  engine overlaps it. FSDP / HSDP: the stage's parameters gathered (compute dtype) behind the first
  forward, gradients reduce-scattered behind the last backward, HSDP's cross-replica all-reduce of the
  shards with them. ZeRO-3: two gathers and a reduce-scatter per micro-batch behind its own compute.
  Whatever a window cannot hide is exposed, and the first unit's gather never is.
- AdamW over the rank's fp32 shards: 32 bytes per parameter through HBM (read parameter, gradient and
  two moments, write three; the gradient norm reads the gradient again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from compiler.planner.candidates import Candidate
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.gpu_time import (
    EngineTraits,
    LayerSeconds,
    block_seconds,
    embedding_seconds,
    head_seconds,
)
from compiler.planner.shape import DecoderShape
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one step on the busiest rank, by cause (they sum to the step)."""
    compute: float
    bubble: float
    tp: float
    pp: float
    dp_exposed: float
    optimizer: float

    @property
    def step(self) -> float:
        return self.compute + self.bubble + self.tp + self.pp + self.dp_exposed + self.optimizer


@dataclass(frozen=True)
class RankWork:
    """Per micro-batch seconds of one pp rank, and what it holds."""
    forward: float
    backward: float
    tp: float
    blocks: int
    params: int  # parameters on this rank (its TP shard of its stages)


def group_link(cluster: GpuCluster, *, members: int, stride: int) -> tuple[float, float, bool]:
    """(bandwidth, latency, spans nodes) of a group of ``members`` ranks ``stride`` apart."""
    per_node = max(1, min(members, cluster.devices_per_node // stride)) if stride <= cluster.devices_per_node else 1
    if members <= per_node:
        return cluster.intra_node_bandwidth * cluster.link_efficiency, cluster.intra_node_latency, False
    bandwidth = min(cluster.intra_node_bandwidth, per_node * cluster.inter_node_bandwidth) * cluster.link_efficiency
    return bandwidth, cluster.inter_node_latency, True


def _collective(nbytes: float, n: int, link: tuple[float, float, bool], *, gather: bool = False) -> float:
    """Ring bandwidth term; latency per ring step inside a node, per tree level across nodes."""
    if n <= 1:
        return 0.0
    bandwidth, latency, spans = link
    steps = 2 * math.ceil(math.log2(n)) if spans else 2 * (n - 1)
    seconds = 2 * (n - 1) / n * nbytes / bandwidth + steps * latency
    return seconds / 2 if gather else seconds


def data_parallel_exposed(c: Candidate, cluster: GpuCluster, traits: EngineTraits, *, rank_params: int, units: int,
                          forward: float, backward: float) -> float:
    """Seconds of DP communication per step left visible after overlap (module docstring)."""
    if c.dp == 1:
        return 0.0
    stride = c.pp * c.mp
    grads = rank_params * traits.grad_reduce_bytes
    if not traits.dp_overlap:
        forward = backward = 0.0
    if c.shard == 1:  # replicate: bucketed all-reduce
        comm = _collective(grads, c.dp, group_link(cluster, members=c.dp, stride=stride))
        return max(0.0, comm - backward)
    dtype = PRECISIONS[c.precision].autocast_dtype
    params = rank_params * (dtype.itemsize if dtype else 4)
    shard_link = group_link(cluster, members=c.shard, stride=stride)
    gather = _collective(params, c.shard, shard_link, gather=True)
    scatter = _collective(grads, c.shard, shard_link, gather=True)
    replicas = _collective(grads / c.shard, c.dp // c.shard,
                           group_link(cluster, members=c.dp // c.shard, stride=stride * c.shard))
    first_unit = gather / max(1, units)
    if c.reshard_after_forward:
        per_microbatch = max(0.0, 2 * gather + scatter - forward - backward) + first_unit
        return c.microbatches * per_microbatch + max(0.0, replicas - backward)
    return first_unit + max(0.0, gather - forward) + max(0.0, scatter + replicas - backward)


def pipeline_message_seconds(c: Candidate, cluster: GpuCluster, traits: EngineTraits, shape: DecoderShape,
                             *, micro_batch_size: int) -> float:
    """One stage micro-batch's activation or gradient message between pipeline neighbours."""
    if c.pp == 1:
        return 0.0
    nbytes = micro_batch_size * shape.seq_len * shape.d_model * PRECISIONS[c.precision].dtype.itemsize
    if traits.p2p_scatter_gather or traits.sequence_parallel:
        nbytes /= c.mp
    inside = c.pp * c.mp <= cluster.devices_per_node
    bandwidth = (cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth) * cluster.link_efficiency
    return (cluster.intra_node_latency if inside else cluster.inter_node_latency) + nbytes / bandwidth


@dataclass(frozen=True)
class LayerTable:
    """Seconds per micro-batch of the embedding, one block and the head for one (mp, mbs, precision, AC)."""
    embedding: LayerSeconds
    block: LayerSeconds
    head: LayerSeconds


def layer_table(shape: DecoderShape, cluster: GpuCluster, traits: EngineTraits, *, micro_batch_size: int, mp: int,
                precision: str, activation_checkpointing: bool) -> LayerTable:
    args = dict(micro_batch_size=micro_batch_size, mp=mp, precision=precision)
    return LayerTable(embedding_seconds(shape, cluster, **args),
                      block_seconds(shape, cluster, traits, activation_checkpointing=activation_checkpointing, **args),
                      head_seconds(shape, cluster, **args))


def rank_work(table: LayerTable, blocks: int, embedding: bool, head: bool, *, block_params: int,
              embedding_params: int, head_params: int) -> RankWork:
    """The work of a rank holding ``blocks`` blocks, and the embedding and / or the head."""
    parts = [(table.block, blocks)] + [(table.embedding, 1)] * embedding + [(table.head, 1)] * head
    params = blocks * block_params + embedding_params * embedding + head_params * head
    return RankWork(sum(x.forward * n for x, n in parts), sum(x.backward * n for x, n in parts),
                    sum(x.tp * n for x, n in parts), blocks, params)


def step_breakdown(c: Candidate, cluster: GpuCluster, traits: EngineTraits, shape: DecoderShape, *,
                   busiest: RankWork, optimizer_params: float) -> StepBreakdown:
    spec = SCHEDULES[c.schedule]
    bubble = 0.0 if c.pp == 1 else (spec.planned_bubble or spec.bubble)(c.pp, c.microbatches, c.stages_per_rank)
    stretch = 1 / (1 - bubble)
    m = c.microbatches
    compute = m * (busiest.forward + busiest.backward)
    tp = m * busiest.tp
    message = pipeline_message_seconds(c, cluster, traits, shape, micro_batch_size=c.micro_batch_size)
    pp = m * 2 * c.stages_per_rank * message
    dp = data_parallel_exposed(c, cluster, traits, rank_params=busiest.params, units=busiest.blocks + 1,
                               forward=busiest.forward, backward=busiest.backward)
    optimizer = optimizer_params * 32 / (cluster.memory_bandwidth * cluster.memory_efficiency)
    return StepBreakdown(compute, (compute + tp + pp) * (stretch - 1), tp, pp, dp, optimizer)
