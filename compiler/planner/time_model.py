"""Step time of a plan on a cluster, from calibrated rates and ring / point-to-point formulas.

Per pp rank and micro-batch: the FLOPs of its layers (per TP shard, counted by compiler/cost.py) at
the calibrated rate of its precision, plus a calibrated fixed cost per layer, plus tensor-parallel
all-reduces (Megatron: 2 in forward and 2 in backward per block, of B x T x d activations) and the
pipeline sends of activations and gradients. The pipeline multiplies the busiest rank's m
micro-batches by 1 / (1 - bubble) with the schedule's bubble fraction (compiler/schedules.py).
DP adds its collectives by mode (``data_parallel_time``: replicate, FSDP, HSDP, ZeRO-3); AdamW and
a calibrated fixed cost per step complete it.

Those formulas price isolated kernels and collectives. A real engine step also pays for what they
leave out: the schedule's Python work and gloo send/recv per pipeline action, collectives among
processes that outnumber the cores, the loss and gradient-norm reductions. ``run.py calibrate``
measures that from short engine runs and fits five factors (cluster.compute_scale, comm_scale,
dp_comm_scale, action_overhead, step_overhead) so that

    step = compute_scale * compute + comm_scale * communication + dp_comm_scale * fsdp + action_overhead * actions
           + optimizer + step_overhead

FSDP's collectives get their own factor: with more processes than cores an all-gather waits for every
peer to be scheduled, which the ring formula prices far lower than TP's and PP's small messages.

(``step_time`` also returns the unscaled terms; compiler/planner/fit.py fits the factors).

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
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Also the time of a reduce-scatter of the same total size."""
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


BUCKET_BYTES = 25 * 2**20  # replicate's gradient buckets (runtime/engine/replicate.py)


def data_parallel_time(c: Candidate, *, rank_params: int, units: int, link: Link) -> float:
    """Seconds of DP communication per step for a rank holding ``rank_params`` in ``units`` FSDP units
    (each block and each stage's root), by DP mode:
    - replicate: one all-reduce of the fp32 gradients in 25 MB buckets (latency per bucket);
    - FSDP / HSDP: an all-gather of the parameters (in the autocast dtype, FSDP's param_dtype) and a
      reduce-scatter of fp32 gradients per unit and step over the ``shard`` group, and for HSDP an
      all-reduce of the gradient shards across the dp / shard replicas;
    - ZeRO-3: the parameters gathered twice (forward and backward) and the gradients reduce-scattered
      once per micro-batch."""
    if c.dp == 1:
        return 0.0
    grads = rank_params * 4
    if c.shard == 1:
        buckets = max(1, -(-grads // BUCKET_BYTES))
        return all_reduce_time(grads, c.dp, link) + (buckets - 1) * 2 * (c.dp - 1) * link.latency
    dtype = PRECISIONS[c.precision].autocast_dtype
    gathered = rank_params * (dtype.itemsize if dtype else 4)
    latency = (units - 1) * (c.shard - 1) * link.latency  # beyond the first unit's, per collective
    gather, scatter = all_gather_time(gathered, c.shard, link) + latency, all_gather_time(grads, c.shard, link) + latency
    replicas = all_reduce_time(grads / c.shard, c.dp // c.shard, link)
    if c.reshard_after_forward:
        return c.microbatches * (2 * gather + scatter) + replicas
    return gather + scatter + replicas


def bubble(schedule: str, *, p: int, m: int, v: int) -> float:
    """The idle fraction the model charges: the schedule's formula, or what it expects to reach where the
    formula is an ideal (compiler/schedules.py, ``planned_bubble``)."""
    spec = SCHEDULES[schedule]
    if p == 1:
        return 0.0
    return (spec.planned_bubble or spec.bubble)(p, m, v)


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per step and its parts, with the cluster's calibrated factors applied."""
    step: float
    compute: float  # busiest rank, all micro-batches
    tp_comm: float
    pp_comm: float
    bubble: float  # idle time of the busiest rank (compute and communication stretched by the bubble)
    dp_comm: float
    optimizer: float
    fixed: float  # per-action and per-step costs


@dataclass(frozen=True)
class StepTerms:
    """The time model's terms before the engine-calibrated factors; the bubble stretches the first three."""
    compute: float  # seconds: busiest rank's compute over the step, including its bubble
    communication: float  # seconds: TP and PP, stretched by the bubble
    fsdp: float  # seconds: FSDP all-gathers and reduce-scatters
    actions: float  # count: forward and backward actions the busiest rank runs, stretched by the bubble
    optimizer: float  # seconds

    def combine(self, cluster: Cluster) -> float:
        return (cluster.compute_scale * self.compute + cluster.comm_scale * self.communication
                + cluster.dp_comm_scale * self.fsdp
                + cluster.action_overhead * self.actions + self.optimizer + cluster.step_overhead)


def step_time(c: Candidate, *, rank_flops: float, rank_layers: int, rank_params: int, seq_len: int, d_model: int,
              cluster: Cluster) -> tuple[TimeEstimate, StepTerms]:
    """The step's time with the cluster's factors applied, and the unscaled terms they multiply (what
    compiler/planner/fit.py fits). ``rank_flops``: one micro-batch's forward + backward FLOPs on the
    busiest pp rank (its v stages)."""
    t = _parts(c, rank_flops=rank_flops, rank_layers=rank_layers, rank_params=rank_params, seq_len=seq_len,
               d_model=d_model, cluster=cluster)
    stretch = 1 / (1 - t["bubble"]) if t["bubble"] < 1 else float("inf")
    terms = StepTerms(compute=t["compute"] * stretch, communication=(t["tp_comm"] + t["pp_comm"]) * stretch,
                      fsdp=t["dp_comm"], actions=t["actions"] * stretch, optimizer=t["optimizer"])
    compute = cluster.compute_scale * t["compute"]
    tp, pp = (cluster.comm_scale * t[k] for k in ("tp_comm", "pp_comm"))
    dp = cluster.dp_comm_scale * t["dp_comm"]
    actions = cluster.action_overhead * t["actions"]
    idle = (compute + tp + pp + actions) * (stretch - 1)  # the bubble stretches everything a stage does
    fixed = actions + cluster.step_overhead
    estimate = TimeEstimate(compute + tp + pp + dp + idle + fixed + t["optimizer"], compute, tp, pp, idle, dp,
                            t["optimizer"], fixed)
    return estimate, terms


def _parts(c: Candidate, *, rank_flops: float, rank_layers: int, rank_params: int, seq_len: int, d_model: int,
           cluster: Cluster) -> dict[str, float]:
    """Unscaled seconds per step of each part (busiest rank), the bubble fraction and the action count."""
    ranks_per_node = min(cluster.ranks_per_node, c.dp * c.pp * c.mp)
    bub = bubble(c.schedule, p=c.pp, m=c.microbatches, v=c.stages_per_rank)
    busy = 1.0 - bub
    slowdown = max(1.0, ranks_per_node * busy / cluster.compute_units_per_node)
    # Full recompute runs each block's forward twice; selective recomputes no matrix product or attention.
    recompute = 4 / 3 if c.activation_checkpointing and not c.selective_checkpointing else 1.0
    # Fewer ranks than units: each rank gets units // ranks threads (runtime/device.py), ~linear here.
    threads = max(1, cluster.compute_units_per_node // ranks_per_node)
    rate = cluster.flops[c.precision] * threads
    per_mb_compute = (rank_flops * recompute / rate + rank_layers * cluster.layer_overhead) * slowdown

    act_bytes = c.micro_batch_size * seq_len * d_model * PRECISIONS[c.precision].activation_bytes
    blocks = rank_layers  # every layer of a rank but embedding/head is a block; close enough for comm
    intra = cluster.intra_node
    tp_link = intra if c.mp <= cluster.ranks_per_node else cluster.inter_node
    per_mb_tp = 4 * blocks * all_reduce_time(act_bytes, c.mp, tp_link)
    pp_link = intra if c.pp * c.mp <= cluster.ranks_per_node else cluster.inter_node
    per_mb_pp = 2 * c.stages_per_rank * pp_link.transfer(act_bytes) if c.pp > 1 else 0.0

    dp_link = intra if c.dp * c.pp * c.mp <= cluster.ranks_per_node else cluster.inter_node
    dp = data_parallel_time(c, rank_params=rank_params, units=rank_layers + c.stages_per_rank, link=dp_link)
    optimizer = rank_params * 4 / max(c.dp, 1) / cluster.optimizer_bytes_per_s if cluster.optimizer_bytes_per_s else 0.0
    # One forward and one backward per stage micro-batch (or F, I and W where the backward is split).
    actions = c.microbatches * c.stages_per_rank * SCHEDULES[c.schedule].actions_per_microbatch
    return {"compute": c.microbatches * per_mb_compute, "tp_comm": c.microbatches * per_mb_tp,
            "pp_comm": c.microbatches * per_mb_pp, "dp_comm": dp, "optimizer": optimizer, "bubble": bub,
            "actions": actions}
