"""One training step of a plan: the busiest pipeline rank's micro-batches stretched by the schedule's bubble,
pipeline messages, data-parallel collectives by mode with the part compute hides, AdamW, and the engine
factors (compiler/planner/cluster.py ``EngineFactors``):

    step = compute_scale x m (compute) / (1 - bubble) + comm_scale x m (TP + CP + EP + PP) / (1 - bubble)
           + dp_comm_scale x DP exposed + action_overhead x actions / (1 - bubble) + optimizer + step_overhead

- The busiest rank is the pp rank whose stages (the engine's split, compiler/planner/split.py, under the
  schedule's placement) take longest per micro-batch; on a CPU its compute slows by the node's ranks
  x busy fraction / cores when they outnumber the cores.
- Pipeline messages: an activation forward and a gradient backward per stage micro-batch, [b, T / cp, d] in
  the compute dtype (1/mp of it under sequence parallelism, or with Megatron's scatter/gather), over the
  link between pipeline neighbours; waited for, not hidden.
- Data parallelism (dense parameters over dp x cp, experts over the expert-data-parallel group): replicate
  all-reduces the gradients in 25 MB buckets behind the last micro-batch's backward; FSDP / HSDP gather the
  stage's parameters (compute dtype) behind the first forward and reduce-scatter the gradients behind the
  last backward, HSDP's cross-replica all-reduce of the shards with them; ZeRO-3 gathers twice and
  reduce-scatters once per micro-batch behind its own compute. The first unit's gather is never hidden, and
  where nothing overlaps (a CPU: gloo and compute share the cores; an engine that reduces after the
  backward) everything is exposed. Every FSDP unit (block, stage root) is a collective of its own.
- AdamW over the rank's shards (compiler/planner/devices.py ``optimizer_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.parallel_plan import ParallelPlan
from compiler.planner.cluster import Cluster, EngineFactors
from compiler.planner.collectives import all_gather_time, all_reduce_time
from compiler.planner.engines import EngineTraits
from compiler.planner.layers import LayerSeconds
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES

BUCKET_BYTES = 25 * 2**20  # replicate's gradient buckets (runtime/engine/replicate.py)


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one step on the busiest rank, by cause (they sum to the step), factors applied."""
    compute: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp_exposed: float
    optimizer: float
    fixed: float  # per-action and per-step costs

    @property
    def step(self) -> float:
        return (self.compute + self.bubble + self.tp + self.cp + self.ep + self.pp + self.dp_exposed
                + self.optimizer + self.fixed)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("compute", "bubble", "tp", "cp", "ep", "pp", "dp_exposed",
                                              "optimizer", "fixed")}


@dataclass(frozen=True)
class StepTerms:
    """The terms before the engine factors (what compiler/planner/fit.py fits); the bubble stretches the first,
    second and fourth."""
    compute: float  # seconds: busiest rank's compute over the step, including its bubble
    communication: float  # seconds: TP, CP, EP and PP, stretched by the bubble
    fsdp: float  # seconds: data-parallel collectives left exposed
    actions: float  # count: forward and backward actions the busiest rank runs, stretched by the bubble
    optimizer: float  # seconds

    def combine(self, f: EngineFactors) -> float:
        return (f.compute_scale * self.compute + f.comm_scale * self.communication + f.dp_comm_scale * self.fsdp
                + f.action_overhead * self.actions + self.optimizer + f.step_overhead)

    def row(self) -> list[float]:
        """The coefficients of the five factors (compiler/planner/fit.py)."""
        return [self.compute, self.communication, self.fsdp, self.actions, 1.0]


def bubble(c: ParallelPlan) -> float:
    """The idle fraction the model charges: the schedule's formula, or what it expects to reach where the
    formula is an ideal (compiler/schedules.py, ``planned_bubble``)."""
    if c.pp == 1:
        return 0.0
    spec = SCHEDULES[c.schedule]
    return (spec.planned_bubble or spec.bubble)(c.pp, c.microbatches, c.stages_per_rank)


@dataclass(frozen=True)
class DataParallelGroups:
    """Who holds the same parameters: dense ones over dp x cp, experts over the expert-data-parallel group."""
    dense: int
    dense_shard: int
    experts: int
    experts_shard: int

    @staticmethod
    def of(c: ParallelPlan) -> "DataParallelGroups":
        dense = c.dp * c.cp
        shard = c.shard * c.cp if (c.shard > 1 or c.cp > 1) else 1
        experts = expert_data_parallel(dp=c.dp, cp=c.cp, mp=c.mp, ep=c.ep)
        return DataParallelGroups(dense, shard, experts, max(1, round(experts * shard / dense)))


def expert_data_parallel(*, dp: int, cp: int, mp: int, ep: int) -> int:
    """Ranks holding the same experts (Megatron-Core's EDP): a stage's dp x cp x mp ranks are ep x EDP, as
    experts are not split by TP (expert tensor parallelism 1: Megatron's --expert-tensor-parallel-size 1,
    torchtitan's default), so TP ranks hold different tokens of the same experts."""
    return max(1, dp * cp * mp // ep)


def data_parallel_seconds(c: ParallelPlan, cluster: Cluster, traits: EngineTraits, *, dense_params: float,
                          expert_params: float, units: int, forward: float, backward: float,
                          strides: dict[str, int]) -> float:
    """Seconds of DP communication per step left visible after overlap (module docstring)."""
    g = DataParallelGroups.of(c)
    if g.dense == 1 and g.experts == 1:
        return 0.0
    topology = cluster.topology
    if not (cluster.device.dp_overlap and traits.dp_overlap):
        forward = backward = 0.0
    dtype = PRECISIONS[c.precision].autocast_dtype
    dense_bytes = expert_bytes = dtype.itemsize if dtype else 4
    if traits.fp8_all_gather and (c.fp8 or traits.float8_linears):
        dense_bytes = expert_bytes = 1  # the blocks' weights, nearly all of a stage's (the embedding and head counted so too)
    elif c.fp8 and c.fp8_all_gather:
        dense_bytes = 1  # this engine's --fp8-all-gather: the FP8 linears' weights; the experts' gather in the precision

    def dense_link(members: int):  # cp ranks (inner) times dp ranks
        return topology.dims_link([(min(members, c.cp), strides["cp"]), (max(1, members // c.cp), strides["dp"])])

    gather = scatter = replicas = allreduce = 0.0
    for params, n, s, link, whole, gather_bytes in (
            (dense_params, g.dense, g.dense_shard, dense_link(g.dense_shard), dense_link(g.dense), dense_bytes),
            (expert_params, g.experts, g.experts_shard, topology.group_link(g.experts_shard, c.ep),
             topology.group_link(g.experts, c.ep), expert_bytes)):
        if not params or n == 1:
            continue
        grads = params * traits.grad_reduce_bytes
        if s == 1:
            buckets = max(1, -(-grads // BUCKET_BYTES))
            allreduce += all_reduce_time(grads, n, whole) + (buckets - 1) * whole.steps(n) * whole.latency
            continue
        per_unit = (units - 1) * link.steps(s) / 2 * link.latency  # each unit's collective pays its latency
        gather += all_gather_time(params * gather_bytes, s, link) + per_unit
        scatter += all_gather_time(grads, s, link) + per_unit
        replica = topology.group_link(n // s, strides["dp"] * max(1, s // c.cp))
        replicas += all_reduce_time(grads / s, n // s, replica)
    if not (forward or backward):
        per_microbatch = 2 * gather + scatter if c.reshard_after_forward else 0.0
        once = 0.0 if c.reshard_after_forward else gather + scatter
        return c.microbatches * per_microbatch + once + replicas + allreduce
    first_unit = gather / max(1, units)
    if c.reshard_after_forward:
        per_microbatch = max(0.0, 2 * gather + scatter - forward - backward) + first_unit
        return c.microbatches * per_microbatch + max(0.0, replicas + allreduce - backward)
    return first_unit + max(0.0, gather - forward) + max(0.0, scatter + replicas + allreduce - backward)


def message_seconds(c: ParallelPlan, cluster: Cluster, traits: EngineTraits, *, seq_len: int, d_model: int,
                    strides: dict[str, int]) -> float:
    """One stage micro-batch's activation or gradient message between pipeline neighbours."""
    if c.pp == 1:
        return 0.0
    nbytes = c.micro_batch_size * seq_len / c.cp * d_model * PRECISIONS[c.precision].dtype.itemsize
    if traits.p2p_scatter_gather or (c.sequence_parallel and traits.sp_messages):
        nbytes /= c.mp
    return cluster.topology.neighbour_link(c.pp, strides["pp"]).transfer(nbytes)


@dataclass(frozen=True)
class Step:
    breakdown: StepBreakdown
    terms: StepTerms

    @property
    def seconds(self) -> float:
        return self.breakdown.step


def step_time(c: ParallelPlan, cluster: Cluster, traits: EngineTraits, *, busiest: LayerSeconds, rank_params: float,
              rank_dense_params: float, units: int, seq_len: int, d_model: int,
              strides: dict[str, int]) -> Step:
    """The step of plan ``c`` whose busiest rank runs ``busiest`` per micro-batch (module docstring)."""
    f = cluster.factors_for(c.world)
    bub = bubble(c)
    stretch = 1 / (1 - bub) if bub < 1 else float("inf")
    ranks_on_node = min(cluster.topology.devices_per_node, c.world)
    slowdown = cluster.device.sharing(ranks_on_node=ranks_on_node, busy=1 - bub)
    m = c.microbatches
    compute = m * (busiest.compute.forward + busiest.compute.backward) * slowdown
    message = message_seconds(c, cluster, traits, seq_len=seq_len, d_model=d_model, strides=strides)
    pp = m * 2 * c.stages_per_rank * message
    tp, cp, ep = m * busiest.tp, m * busiest.cp, m * busiest.ep
    dp = data_parallel_seconds(c, cluster, traits, dense_params=rank_dense_params,
                               expert_params=rank_params - rank_dense_params, units=units,
                               forward=busiest.compute.forward, backward=busiest.compute.backward, strides=strides)
    g = DataParallelGroups.of(c)
    optimizer = cluster.device.optimizer_seconds(rank_dense_params / g.dense_shard
                                                 + (rank_params - rank_dense_params) / g.experts_shard)
    actions = m * c.stages_per_rank * SCHEDULES[c.schedule].actions_per_microbatch
    terms = StepTerms(compute * stretch, (tp + cp + ep + pp) * stretch, dp, actions * stretch, optimizer)
    scaled = [f.compute_scale * compute, f.comm_scale * tp, f.comm_scale * cp, f.comm_scale * ep, f.comm_scale * pp]
    action_seconds = f.action_overhead * actions
    idle = (sum(scaled) + action_seconds) * (stretch - 1)
    breakdown = StepBreakdown(scaled[0], idle, scaled[1], scaled[2], scaled[3], scaled[4], f.dp_comm_scale * dp,
                              optimizer, action_seconds + f.step_overhead)
    return Step(breakdown, terms)
