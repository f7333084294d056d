"""What the planner tells a user (compiler/planner/advice.py): the binding constraint, why the next plans lose,
and the cheapest change that makes a model fit."""

from __future__ import annotations

import dataclasses

from compiler.planner.advice import binding_constraint, cheapest_fit, why_slower
from compiler.planner.candidates import Constraints
from compiler.planner.cluster import load_cluster
from compiler.planner.search import search
from compiler.planner.shape import DecoderShape
from models import named_config

H100 = load_cluster("h100-80gb")
LLAMA_70B = DecoderShape.from_config(named_config("llama3-70b"))


def test_memory_binds_when_a_faster_plan_does_not_fit():
    args = dict(world=64, global_batch_size=64, cluster=H100)
    best = search(LLAMA_70B, **args).best
    unconstrained = search(LLAMA_70B, require_fit=False, **args).best
    assert unconstrained.step_time < best.step_time  # a faster plan exists; it needs more memory than a GPU has
    line = binding_constraint(best, unconstrained)
    assert line.startswith("memory:") and unconstrained.plan.describe() in line
    assert not binding_constraint(best, best).startswith("memory")  # else: the largest part beside compute


def test_runners_up_say_which_parts_of_their_step_are_longer():
    result = search(LLAMA_70B, world=64, global_batch_size=64, cluster=H100, keep=3)
    best, second = result.top[0], result.top[1]
    assert why_slower(second, best).startswith(f"{second.step_time / best.step_time:.3f}x")
    slower = dataclasses.replace(best, step_time=best.step_time * 1.2, breakdown=dataclasses.replace(
        best.breakdown, bubble=best.breakdown.bubble + 0.2 * best.step_time))
    assert "pipeline bubble" in why_slower(slower, best)


def test_the_cheapest_change_that_fits_a_layout_that_does_not():
    given = Constraints(dp=8, pp=1, mp=8, ac="none", cp=1)
    assert search(LLAMA_70B, world=64, global_batch_size=64, cluster=H100, constraints=given).best is None

    def run(constraints, world):
        return search(LLAMA_70B, world=world, global_batch_size=64, cluster=H100, constraints=constraints)

    fix = cheapest_fit(run, given, 64, has_experts=False)
    assert fix is not None and fix.result.fits and fix.what.startswith(("add", "use"))
    # No change tried is faster per GPU than the one named.
    for constraints, world in ((dataclasses.replace(given, ac="full"), 64), (dataclasses.replace(given, dp=16), 128)):
        other = run(constraints, world).best
        assert other is None or other.step_time * world >= fix.result.step_time * fix.world - 1e-9


def test_a_runner_up_priced_as_fast_says_so_and_how_it_differs():
    best = search(LLAMA_70B, world=64, global_batch_size=64, cluster=H100).best
    twin = dataclasses.replace(best, plan=dataclasses.replace(best.plan, chunked_loss=False, schedule="zero-bubble"),
                               memory_per_rank=best.memory_per_rank + 2**30)
    line = why_slower(twin, best)
    assert line.startswith("1.000x the best's step: priced as fast, ranked after it (schedule zero-bubble, the "
                           "whole-logits loss (this engine's is chunked);")
    assert f"{twin.memory_per_rank / 2**30:.2f} GiB per rank against {best.memory_per_rank / 2**30:.2f}" in line


def test_of_plans_priced_as_fast_the_one_with_the_chunked_loss_ranks_first():
    """The chunked loss saves memory and never time: the engine's loss comes first among ties."""
    top = search(LLAMA_70B, world=64, global_batch_size=64, cluster=H100, keep=6).top
    for i, e in enumerate(top):
        twins = [o for o in top if o.plan == dataclasses.replace(e.plan, chunked_loss=not e.plan.chunked_loss)]
        if twins and twins[0].step_time == e.step_time:
            assert (top.index(twins[0]) > i) == e.plan.chunked_loss
    assert top[0].plan.chunked_loss
