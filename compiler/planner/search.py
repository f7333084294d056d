"""Search every plan of a model on a cluster (each priced by compiler/planner/pricer.py): one model and one
search for a CPU machine and for tens of thousands of GPUs.

The plan space: every (dp, pp, mp, cp) of the world (mp within a node unless ``max_mp`` allows more, cp up
to ``max_cp``), ep over the divisors of dp x cp x mp that divide the experts, every schedule of the registry
but naive with its v (looped schedules: 2 to 8 stages per rank while the layers last), every micro-batch
size dividing a replica's batch, activation checkpointing none / selective / full, the precisions asked
for, sequence parallelism (mp > 1), the DP modes (FSDP, ZeRO-3, replicate, HSDP; under tensorwise FP8 a sharded one
also with --fp8-all-gather) and the chunked loss.
What the user fixed (``Constraints``) is held. ``validate`` adds the engine's own checks (``--auto`` and the
CPU planner ask it; a GPU ``plan`` prices what the model can price, including what the engine lacks yet).

Pruning keeps the answer exact: layer times depend only on the group (mesh, ep, micro-batch, AC, precision,
SP), whose lower bound is its average pp rank's time with no bubble; groups are priced in order of their
bounds until a bound reaches the ``keep``-th best plan found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable

from compiler.context_gather import AUTO, KV, LATENT, cp_gather_problem
from compiler.lora import LoraConfig
from compiler.parallel_plan import AC, ParallelPlan, dp_mode_name, fp8_all_gather_problem
from compiler.planner.candidates import Constraints, dp_modes, mesh_misfit, mesh_shapes
from compiler.planner.cluster import Cluster
from compiler.planner.engines import THIS_ENGINE, EngineTraits
from compiler.planner.pricer import Estimate, Pricer, price
from compiler.planner.shape import DecoderShape
from compiler.planner.split import Holding
from compiler.planner.step import bubble
from compiler.schedules import SCHEDULES, zero3_problem

__all__ = ["Estimate", "Pricer", "SearchResult", "price", "search"]

MAX_LOOPED_V = 8
AC_ORDER = ("none", "selective", "full")

# A plan -> the one-line error the engine would print for it, or None if it would run it.
Validator = Callable[[ParallelPlan], "str | None"]


def default_max_cp(shape: DecoderShape) -> int:
    """Context parallelism pays for long sequences only: up to T / 8192 ranks (16 at most)."""
    return max(1, min(16, shape.seq_len // 8192))


def search_bounds(shape: DecoderShape, cluster: Cluster, constraints: Constraints, *, world: int) -> tuple[int, int]:
    """The largest mp and cp the search tries: ``constraints``' bounds, else a node's devices (a CPU: the world) and
    ``default_max_cp`` (a CPU: 1)."""
    return (constraints.max_mp or (cluster.devices_per_node if cluster.is_gpu else world),
            constraints.max_cp or (default_max_cp(shape) if cluster.is_gpu else 1))


def fp8_error(recipes: tuple[str | None, ...], cluster: Cluster) -> str | None:
    """Why ``cluster`` cannot train with these FP8 recipes (its GPU has no FP8 matrix units: an A100), or None.
    A CPU runs the recipes emulated, priced at its calibrated rate of the precision."""
    if any(recipes) and cluster.is_gpu and "fp8" not in cluster.device.peak_flops:
        return (f"--fp8: {cluster.name} has no FP8 matrix rate (no \"fp8\" in its peak_tflops: FP8 tensor cores "
                f"came with Hopper and Ada); plan without --fp8")
    return None


def schedule_choices(pp: int, stages: int) -> list[tuple[str, int]]:
    """(schedule, v) for pp ranks and at most ``stages`` stages."""
    layers = stages
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name, spec in SCHEDULES.items():
        if not spec.planner_v:
            continue  # naive: never planned
        vs = [spec.fixed_v] if spec.fixed_v else range(2, MAX_LOOPED_V + 1)
        out += [(name, v) for v in vs if pp * v <= layers]
    return out


def structural_error(c: ParallelPlan, shape: DecoderShape, extra_stages: int = 0) -> str | None:
    """The engine's pipeline rules (runtime/config.py) and the shape's divisibility, from the plan alone."""
    spec = SCHEDULES[c.schedule]
    if c.pp * c.stages_per_rank > shape.layers + extra_stages:
        return "too few layers for pp x v stages"
    if c.microbatches < spec.min_microbatches_per_pp * c.pp:
        return "too few micro-batches for the schedule"
    if spec.microbatches_multiple_of_pp and c.microbatches % c.pp:
        return "micro-batches not a multiple of pp"
    if c.sequence_parallel and shape.seq_len % c.mp:
        return "sequence parallelism needs mp to divide the sequence"
    if c.cp > 1 and shape.seq_len % (2 * c.cp):
        return "context parallelism needs 2 cp to divide the sequence (load-balanced chunks)"
    return shape.shard_error(c.mp) or shape.expert_error(c.ep)


UNMATCHED = "no plan has every value the layout fixes"


def unmatched(constraints: Constraints, shape: DecoderShape, *, world: int, global_batch_size: int,
              extra_stages: int = 0) -> str:
    """Why no plan of the space has the values a user fixed (a search that considered none says this)."""
    c = constraints
    mesh = {k: getattr(c, k) for k in ("dp", "pp", "mp", "cp") if getattr(c, k)}
    product = mesh_misfit(mesh, world)
    if product:
        return f"{' x '.join(f'{k} {n}' for k, n in mesh.items())} is {product} ranks, not {world}"
    if c.dp and global_batch_size % c.dp:
        return f"dp {c.dp} does not divide the batch of {global_batch_size}"
    if c.dp and c.micro_batch_size and (global_batch_size // c.dp) % c.micro_batch_size:
        return f"micro-batch {c.micro_batch_size} does not divide a replica's {global_batch_size // c.dp} sequences"
    if c.ep and c.ep > 1 and (shape.experts is None or shape.experts.count % c.ep):
        return shape.expert_error(c.ep)
    if c.pp:
        stages = shape.layers + extra_stages
        if c.stages_per_rank and c.pp * c.stages_per_rank > stages:
            return "too few layers for pp x v stages"
        wanted = c.schedules() or ()
        choices = schedule_choices(c.pp, stages)
        runs = [n for n, v in choices if n in wanted and c.stages_per_rank in (None, v)]
        if wanted and not runs:
            vs = sorted({v for n, v in choices if n in wanted})
            return (f"{' or '.join(wanted)} at pp {c.pp} runs v in {vs or 'none'}"
                    + (f", not {c.stages_per_rank}" if c.stages_per_rank else ""))
    return UNMATCHED


def _gathering_modes(modes: list[tuple[int | None, bool]], gathers: tuple[bool, ...], *, dp: int, cp: int,
                     fp8: str | None) -> list[tuple[int | None, bool, bool]]:
    """(dp_shard, reshard_after_forward, fp8_all_gather): each DP mode with each --fp8-all-gather choice the engine
    runs it with (compiler/parallel_plan.py ``fp8_all_gather_problem``)."""
    return [(shard, zero3, gather) for shard, zero3 in modes for gather in gathers
            if not gather or fp8_all_gather_problem(ParallelPlan(dp=dp, cp=cp, dp_shard=shard, fp8=fp8,
                                                                 fp8_all_gather=True)) is None]


def schedule_modes(modes: list[tuple[int | None, bool, bool]], schedule: str,
                   traits: EngineTraits) -> list[tuple[int | None, bool, bool]]:
    """The DP modes the engine runs under ``schedule``: without ZeRO-3 under a split backward where the engine cannot
    (compiler/schedules.py ``zero3_problem``)."""
    if traits.zero3_split_backward:
        return modes
    return [m for m in modes if zero3_problem(schedule, reshard_after_forward=m[1]) is None]


def cp_gather_choices(held: tuple[str, ...] | None, shape: DecoderShape, *, cp: int, fp8: str | None) -> tuple[str, ...]:
    """What CP may gather in a group (ParallelPlan.cp_gather): the ``held`` choices the engine runs
    (compiler/context_gather.py ``cp_gather_problem``); unheld, latent and kv both where there is a choice (latent
    attention, cp > 1, no FP8), else auto (one path only)."""
    if held is not None:
        return tuple(g for g in held if cp_gather_problem(g, latent_attention=shape.latent is not None,
                                                          fp8=fp8 is not None) is None)
    return (LATENT, KV) if shape.latent is not None and cp > 1 and fp8 is None else (AUTO,)


def cp_gather_error(held: tuple[str, ...] | None, shape: DecoderShape, recipes: tuple[str | None, ...]) -> str | None:
    """Why no plan can gather what ``held`` says (--cp-gather latent on a model without latent attention, or with
    every FP8 recipe asked for), or None."""
    if held is None or any(cp_gather_choices(held, shape, cp=2, fp8=fp8) for fp8 in recipes):
        return None
    return cp_gather_problem(held[0], latent_attention=shape.latent is not None, fp8=True)


def constraints_error(shape: DecoderShape, cluster: Cluster, constraints: Constraints) -> str | None:
    """Why no plan can hold ``constraints`` (FP8 on a GPU without FP8 units, a CP gather the model cannot run), or
    None: checked before a search, so a command can say it before printing anything."""
    return fp8_error(constraints.fp8, cluster) or cp_gather_error(constraints.cp_gather, shape, constraints.fp8)


def _plans(dp: int, pp: int, mp: int, schedule: str, v: int, modes: list[tuple[int | None, bool, bool]],
           chunks: tuple[bool, ...], *, m: int, mbs: int, precision: str, ac: str, sp: bool, cp: int,
           ep: int, fp8: str | None = None, cp_gather: str = AUTO) -> list[ParallelPlan]:
    """A group's plans of one schedule: one per DP mode (with or without --fp8-all-gather) and loss. Built only when
    the search prices that group (most are pruned by their bound; building millions of plans took most of a large
    search's time)."""
    ac = AC(ac)
    return [ParallelPlan(dp=dp, pp=pp, mp=mp, cp=cp, ep=ep, schedule=schedule, stages_per_rank=v, microbatches=m,
                         micro_batch_size=mbs, precision=precision, ac=ac, dp_shard=shard, reshard_after_forward=zero3,
                         sequence_parallel=sp, chunked_loss=chunked, fp8=fp8, fp8_all_gather=gather, cp_gather=cp_gather)
            for shard, zero3, gather in modes for chunked in chunks]


@dataclass(frozen=True)
class SearchResult:
    top: list[Estimate]  # the fastest plans (that fit, unless the search was asked to ignore memory), fastest first
    considered: int  # plans in the space (those skipped by the bound included)
    priced: int  # plans whose step time was computed
    infeasible: Counter  # reason -> plans
    every: list[Estimate] | None = None  # with ``collect=True``: every plan, feasible first, fastest first
    fixed: str | None = None  # when no plan has the values the user fixed: which one rules them out

    @property
    def best(self) -> Estimate | None:
        return self.top[0] if self.top else None

    def reasons(self) -> str:
        if self.fixed:  # the other meshes' reasons would only hide it
            return self.fixed
        return ", ".join(f"{n} x {r}" for r, n in self.infeasible.most_common()) or "none"


def _expert_choices(shape: DecoderShape, dp: int, cp: int, mp: int, max_ep: int | None) -> list[int]:
    if shape.experts is None:
        return [1]
    pool = dp * cp * mp
    return [e for e in range(1, min(pool, max_ep or pool) + 1) if pool % e == 0 and shape.experts.count % e == 0]


def _groups(shape: DecoderShape, *, world: int, global_batch_size: int, cluster: Cluster, precisions: tuple[str, ...],
            constraints: Constraints, infeasible: Counter):
    """(dp, pp, mp, cp, ep, micro-batch, AC, precision, SP, FP8 recipe, CP gather) groups the constraints admit."""
    max_mp, max_cp = search_bounds(shape, cluster, constraints, world=world)
    for dp, pp, mp, cp in mesh_shapes(world, max_cp=max(max_cp, constraints.cp or 1)):
        if any(want is not None and want != got for want, got in (
                (constraints.dp, dp), (constraints.pp, pp), (constraints.mp, mp), (constraints.cp, cp))):
            continue
        reason = ("mp beyond a node" if mp > max_mp else "dp does not divide the batch" if global_batch_size % dp
                  else "too few layers" if pp > shape.layers else shape.shard_error(mp))
        if reason:
            infeasible[reason] += 1
            continue
        per_replica = global_batch_size // dp
        c = constraints
        for ep in _expert_choices(shape, dp, cp, mp, c.max_ep):
            for mbs in (b for b in range(1, per_replica + 1) if per_replica % b == 0):
                for ac in c.ac_modes or AC_ORDER:
                    for precision in precisions:
                        for sp in ((False, True) if mp > 1 else (False,)):
                            if all(want is None or want == got for want, got in (
                                    (c.ep, ep), (c.micro_batch_size, mbs), (c.ac, ac), (c.precision, precision),
                                    (c.sequence_parallel, sp))):
                                for fp8 in c.fp8:
                                    for gather in cp_gather_choices(c.cp_gather, shape, cp=cp, fp8=fp8):
                                        yield dp, pp, mp, cp, ep, mbs, ac, precision, sp, fp8, gather


def search(shape: DecoderShape, *, world: int, global_batch_size: int, cluster: Cluster,
           traits: EngineTraits = THIS_ENGINE, precisions: tuple[str, ...] = ("bf16",),
           constraints: Constraints = Constraints(), validate: Validator | None = None, keep: int = 1,
           require_fit: bool = True, collect: bool = False, faster_than: float = float("inf"),
           lora: LoraConfig | None = None) -> SearchResult:
    """The ``keep`` fastest plans that fit (all plans with ``require_fit=False``), and only those faster than
    ``faster_than`` seconds a step (a bound that prunes: "is any plan faster than this one?"). ``collect``
    prices every plan (no pruning) and returns them all, infeasible ones with their reason (the CPU planner's
    table). ``lora``: the model frozen, LoRA's adapters trained (compiler/planner/pricer.py)."""
    pricer = Pricer(shape, cluster, traits, lora=lora)
    kinds = shape.kinds()
    everything = Holding(tuple((k, kinds.count(k)) for k in sorted(set(kinds))), True, True)
    infeasible: Counter = Counter()
    groups = []
    considered = 0
    error = constraints_error(shape, cluster, constraints)
    if error:
        raise ValueError(error)
    for dp, pp, mp, cp, ep, mbs, ac, precision, sp, fp8, cp_gather in _groups(
            shape, world=world, global_batch_size=global_batch_size, cluster=cluster, precisions=precisions,
            constraints=constraints, infeasible=infeasible):
        m = global_batch_size // dp // mbs
        per_node = max(1, cluster.devices_per_node // (pp * mp * cp))
        # The chunked loss first: of plans priced equally fast (it saves memory, never time) the one the engine runs.
        chunks = (True, False) if constraints.chunked_loss is None else (constraints.chunked_loss,)
        modes = _gathering_modes([(shard, zero3) for shard, zero3 in dp_modes(dp, cp=cp, per_node=per_node)
                                  if constraints.dp_mode in (None, dp_mode_name(dp, cp, shard, zero3))],
                                 constraints.fp8_all_gather, dp=dp, cp=cp, fp8=fp8)
        wanted = constraints.schedules()
        plan_of = partial(_plans, dp, pp, mp, m=m, mbs=mbs, precision=precision, ac=ac, sp=sp, cp=cp, ep=ep, fp8=fp8,
                          cp_gather=cp_gather)
        by_schedule = [(partial(plan_of, name, v, runs[:1], chunks[:1]), partial(plan_of, name, v, runs, chunks),
                        len(runs) * len(chunks))
                       for name, v in schedule_choices(pp, shape.layers + traits.extra_stages)
                       if (wanted is None or name in wanted) and constraints.stages_per_rank in (None, v)
                       for runs in [schedule_modes(modes, name, traits)] if runs]
        considered += sum(count for _, _, count in by_schedule)
        if by_schedule:
            table = pricer.table(pricer.setup(by_schedule[0][0]()[0]))
            groups.append((m * table.rank(everything).total / pp, by_schedule))
    if not considered:  # what the user fixed rules out every plan: say which value, before the meshes' reasons
        why = unmatched(constraints, shape, world=world, global_batch_size=global_batch_size,
                        extra_stages=traits.extra_stages)
        fixed = why if why != UNMATCHED or not infeasible else None
    else:
        fixed = None
    groups.sort(key=lambda g: g[0])
    top: list[Estimate] = []
    every: list[Estimate] = []
    priced = 0

    def cutoff() -> float:
        if collect:
            return float("inf")
        return top[-1].step_time if len(top) >= keep else faster_than

    for bound, by_schedule in groups:
        if bound >= cutoff():
            break  # every later group is bounded higher still
        for first_plan, plans, count in by_schedule:
            first = first_plan()[0]
            if bound / (1 - bubble(first)) >= cutoff():
                continue
            error = structural_error(first, shape, traits.extra_stages)  # the same for every DP mode and loss of this schedule
            if error:
                infeasible[error] += count
                every.extend(Estimate(c, False, error) for c in plans()) if collect else None
                continue
            limit = pricer.memory_limit(first, constraints.headroom)
            if require_fit and not collect and pricer.memory_floor(first) > limit:
                infeasible["out of memory"] += count  # not even its shards and activations fit
                continue
            for c in plans():
                error = validate(c) if validate else None
                if error:
                    infeasible[error.split(";")[0]] += 1
                    every.extend([Estimate(c, False, error)] if collect else [])
                    continue
                memory = pricer.memory(c)
                if max(memory) > limit and require_fit and not collect:
                    infeasible["out of memory"] += 1
                    continue
                e = pricer.price(c, memory=memory, headroom=constraints.headroom)
                priced += 1
                if not e.feasible:
                    infeasible["out of memory"] += 1
                if collect:
                    every.append(e)
                if (e.feasible or not require_fit) and e.step_time < cutoff():
                    top = sorted([*top, e], key=lambda x: x.step_time)[:keep]
    ordered = sorted(every, key=lambda e: (not e.feasible, e.step_time if e.feasible else 0.0)) if collect else None
    if collect:
        top = [e for e in ordered if e.feasible][:keep]
    return SearchResult(top, considered, priced, infeasible, ordered, fixed)
