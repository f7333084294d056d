"""Step time of a plan on a cluster, from calibrated rates and ring / point-to-point formulas.

Per pp rank and micro-batch: the FLOPs of its layers (per TP shard, counted by compiler/cost.py) at
the calibrated rate of its precision, plus a calibrated fixed cost per layer, plus tensor-parallel
all-reduces (Megatron: 2 in forward and 2 in backward per block, of B x T x d activations) and the
pipeline sends of activations and gradients. The pipeline multiplies the busiest rank's m
micro-batches by 1 / (1 - bubble) with the schedule's bubble fraction (runtime/schedules.py).
FSDP adds one all-gather and one reduce-scatter of the stage's fp32 parameters per step; AdamW and
a calibrated fixed cost per step complete it.

Ring all-reduce over n ranks: 2 (n - 1) / n * S / bandwidth + 2 (n - 1) * latency; all-gather and
reduce-scatter: half of that each (Patarasuk and Yuan 2009; Thakur et al. 2005).
When more ranks share a node than it has compute units (CPU cores), ranks that compute at the same
time share them: compute slows by (ranks per node x busy fraction) / units when that exceeds 1.
With fewer ranks than units, each rank runs units // ranks threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.planner.candidates import Candidate
from compiler.planner.cluster import Cluster, Link

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Also the time of a reduce-scatter of the same total size."""
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def bubble(schedule: str, *, p: int, m: int, v: int) -> float:
    from runtime.schedules import bubble_fraction

    # Zero-bubble reaches ~0 only when F, B and W take equal time; we charge it interleaved's bubble.
    return bubble_fraction("interleaved-1f1b" if schedule == "zero-bubble" else schedule, p=p, m=m, v=v)


@dataclass(frozen=True)
class TimeEstimate:
    step: float
    compute: float  # busiest rank, all micro-batches
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    fixed: float


def step_time(c: Candidate, *, rank_flops: float, rank_layers: int, rank_params: int, seq_len: int, d_model: int,
              cluster: Cluster) -> TimeEstimate:
    """``rank_flops``: one micro-batch's forward + backward FLOPs on the busiest pp rank (its v stages)."""
    ranks_per_node = min(cluster.ranks_per_node, c.dp * c.pp * c.mp)
    bub = bubble(c.schedule, p=c.pp, m=c.microbatches, v=c.stages_per_rank)
    busy = 1.0 - bub
    slowdown = max(1.0, ranks_per_node * busy / cluster.compute_units_per_node)
    recompute = 4 / 3 if c.activation_checkpointing else 1.0
    # Fewer ranks than units: each rank gets units // ranks threads (runtime/device.py), ~linear here.
    threads = max(1, cluster.compute_units_per_node // ranks_per_node)
    rate = cluster.flops[c.precision] * threads
    per_mb_compute = (rank_flops * recompute / rate + rank_layers * cluster.layer_overhead) * slowdown

    act_bytes = c.micro_batch_size * seq_len * d_model * ACTIVATION_BYTES[c.precision]
    blocks = rank_layers  # every layer of a rank but embedding/head is a block; close enough for comm
    intra = cluster.intra_node
    tp_link = intra if c.mp <= cluster.ranks_per_node else cluster.inter_node
    per_mb_tp = 4 * blocks * all_reduce_time(act_bytes, c.mp, tp_link)
    pp_link = intra if c.pp * c.mp <= cluster.ranks_per_node else cluster.inter_node
    per_mb_pp = 2 * c.stages_per_rank * pp_link.transfer(act_bytes) if c.pp > 1 else 0.0

    busy_time = c.microbatches * (per_mb_compute + per_mb_tp + per_mb_pp)
    pipeline = busy_time / (1 - bub) if bub < 1 else float("inf")
    dp_link = intra if c.dp * c.pp * c.mp <= cluster.ranks_per_node else cluster.inter_node
    dp = 2 * all_gather_time(rank_params * 4, c.dp, dp_link) if c.dp > 1 else 0.0
    optimizer = rank_params * 4 / max(c.dp, 1) / cluster.optimizer_bytes_per_s if cluster.optimizer_bytes_per_s else 0.0
    total = pipeline + dp + optimizer + cluster.step_overhead
    return TimeEstimate(total, c.microbatches * per_mb_compute, c.microbatches * per_mb_tp,
                        c.microbatches * per_mb_pp, pipeline - busy_time, dp, optimizer, cluster.step_overhead)
