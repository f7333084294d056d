"""What a plan's numbers mean for the user: the constraint that binds the best plan, why the next-best plans
lose, and for a model that does not fit the cheapest change that makes it fit.

- The binding constraint: memory, when a faster plan exists that does not fit (the search's best with
  memory ignored beats the best that fits); otherwise the largest part of the step beside compute (the
  bubble, TP on its link, DP over the network, CP, EP, pipeline messages).
- Why a plan loses: the parts of its step that exceed the best plan's, largest first.
- The cheapest change that fits: each change a user can make (sequence parallelism, selective or full
  activation checkpointing, the chunked loss, ZeRO-3, context parallelism, expert parallelism, twice the
  ranks) searched with the rest held; of those that fit, the fastest per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from compiler.parallel_plan import ParallelPlan
from compiler.planner.candidates import Constraints
from compiler.planner.search import Estimate, SearchResult

PARTS = {"bubble": "the pipeline bubble", "tp": "tensor-parallel collectives", "cp": "context-parallel K/V gathers",
         "ep": "expert all-to-alls", "pp": "pipeline messages", "dp_exposed": "data-parallel traffic left exposed",
         "optimizer": "the optimizer step", "fixed": "fixed per-step costs"}


# Memory binds the best plan when one that does not fit would take less than this share of its step.
MEMORY_BINDS_BELOW = 0.98


def binding_constraint(best: Estimate, unconstrained: Estimate | None) -> str:
    """One line naming what limits ``best`` (``unconstrained``: the fastest plan with memory ignored, or None
    when none is faster than ``MEMORY_BINDS_BELOW`` x its step)."""
    if unconstrained is not None and unconstrained.step_time < best.step_time * MEMORY_BINDS_BELOW:
        return (f"memory: {unconstrained.plan.describe()} would be {best.step_time / unconstrained.step_time:.2f}x "
                f"as fast but needs {unconstrained.memory_per_rank / 2**30:.1f} GiB of "
                f"{unconstrained.memory_limit / 2**30:.1f} per rank")
    b = best.breakdown.to_dict()
    part, seconds = max(((k, v) for k, v in b.items() if k != "compute"), key=lambda kv: kv[1])
    if seconds <= 0.02 * best.step_time:
        return f"compute: {100 * b['compute'] / best.step_time:.0f}% of the step; nothing else above 2%"
    return (f"{PARTS[part]}: {seconds:.3f} s of {best.step_time:.3f} s ({100 * seconds / best.step_time:.0f}%), "
            f"compute {100 * b['compute'] / best.step_time:.0f}%")


def why_slower(e: Estimate, best: Estimate) -> str:
    """The parts of ``e``'s step that exceed ``best``'s, largest first; a plan priced as fast says so and how it
    differs (a tie is ranked by the search's order of preference, compiler/planner/search.py)."""
    mine, theirs = e.breakdown.to_dict(), best.breakdown.to_dict()
    extra = sorted(((mine[k] - theirs[k], k) for k in mine if mine[k] > theirs[k] * 1.001 + 1e-9), reverse=True)
    parts = ", ".join(f"+{d:.3f} s {PARTS.get(k, k)}" for d, k in extra[:2])
    ratio = f"{e.step_time / best.step_time:.3f}x the best's step"
    if parts:
        return f"{ratio} ({parts})"
    if e.step_time <= best.step_time * 1.0005:
        return (f"{ratio}: priced as fast, ranked after it ({plan_difference(e.plan, best.plan)}; "
                f"{e.memory_per_rank / 2**30:.2f} GiB per rank against {best.memory_per_rank / 2**30:.2f})")
    return ratio


def plan_difference(plan: ParallelPlan, best: ParallelPlan) -> str:
    """How ``plan`` differs from ``best`` in words: each field whose value differs, as ``plan`` has it."""
    words = {"chunked_loss": lambda v: "the chunked loss" if v else "the whole-logits loss (this engine's is chunked)",
             "sequence_parallel": lambda v: "sequence parallelism" if v else "no sequence parallelism",
             "reshard_after_forward": lambda v: "ZeRO-3" if v else "parameters kept after the forward",
             "fp8_all_gather": lambda v: "FP8 all-gathers" if v else "all-gathers in the precision"}
    differ = [f.name for f in fields(ParallelPlan) if getattr(plan, f.name) != getattr(best, f.name)]
    return ", ".join(words[n](getattr(plan, n)) if n in words else f"{n.replace('_', ' ')} {getattr(plan, n)}"
                     for n in differ) or "the same plan"


@dataclass(frozen=True)
class Change:
    what: str  # the change in words
    constraints: Constraints
    world: int
    result: Estimate


CHANGES: tuple[tuple[str, Callable[[Constraints], Constraints | None]], ...] = (
    ("sequence parallelism", lambda c: replace(c, sequence_parallel=True) if c.sequence_parallel is not True else None),
    ("selective activation checkpointing", lambda c: replace(c, ac="selective") if c.ac != "selective" else None),
    ("full activation checkpointing", lambda c: replace(c, ac="full") if c.ac != "full" else None),
    ("the chunked loss", lambda c: replace(c, chunked_loss=True) if c.chunked_loss is not True else None),
    ("ZeRO-3 (parameters resharded after the forward)",
     lambda c: replace(c, dp_mode="zero3") if c.dp_mode != "zero3" else None),
    ("context parallelism x2", lambda c: replace(c, cp=(c.cp or 1) * 2, max_cp=max(2 * (c.cp or 1), c.max_cp or 1),
                                                   dp=c.dp // 2 if c.dp and c.dp % 2 == 0 else c.dp)),
    ("expert parallelism", lambda c: replace(c, ep=None, max_ep=None) if c.ep in (None, 1) else None),
)


def cheapest_fit(search_fn: Callable[[Constraints, int], SearchResult], given: Constraints, world: int,
                 *, has_experts: bool) -> Change | None:
    """The fitting plan of the changes above (and of twice the ranks) fastest per GPU, or None.
    ``search_fn(constraints, world)`` runs the planner's search."""
    options = []
    for what, change in CHANGES:
        if what == "expert parallelism" and not has_experts:
            continue
        constraints = change(given)
        if constraints is None:
            continue
        best = search_fn(constraints, world).best
        if best is not None:
            options.append(Change(f"add {what}", constraints, world, best))
    doubled = replace(given, dp=given.dp * 2 if given.dp else None)
    best = search_fn(doubled, 2 * world).best
    if best is not None:
        options.append(Change(f"use {2 * world} ranks", doubled, 2 * world, best))
    # GPU-seconds per token: the same work on twice the ranks must be twice as fast to cost the same.
    return min(options, key=lambda o: o.result.step_time * o.world, default=None)
