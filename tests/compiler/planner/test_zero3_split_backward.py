"""ZeRO-3 under a split-backward schedule (zero-bubble, zbv, dualpipev): the engine refuses it
(compiler/schedules.py ``zero3_problem``), so the planner never prices it for this engine, on a GPU cluster
(where ``plan`` has no engine check) as on this machine; a published engine's plans keep it."""

from __future__ import annotations

import functools

import pytest

from compiler.planner.cluster import load_cluster
from compiler.planner.engines import THIS_ENGINE, TORCHTITAN
from compiler.planner.search import search
from compiler.planner.shape import DecoderShape
from compiler.schedules import SCHEDULES
from models import named_config
from runtime.commands import plan as plan_command

SHAPE = DecoderShape.from_config(named_config("medium"))


@functools.cache
def _every_plan(engine: str):
    traits = {"this": THIS_ENGINE, "torchtitan": TORCHTITAN}[engine]
    return search(SHAPE, world=8, global_batch_size=32, cluster=load_cluster("h100-80gb"), precisions=("bf16",),
                  traits=traits, collect=True).every


def _kinds(plans) -> set[tuple[bool, bool]]:
    """(split backward, ZeRO-3) of each plan."""
    return {(SCHEDULES[e.plan.schedule].split_backward, e.plan.reshard_after_forward) for e in plans}


def test_this_engines_gpu_plans_never_reshard_under_a_split_backward():
    assert _kinds(_every_plan("this")) == {(False, False), (False, True), (True, False)}


def test_a_published_engines_plans_keep_zero3_under_a_split_backward():
    assert (True, True) in _kinds(_every_plan("torchtitan"))


@pytest.mark.parametrize("schedule", ["zbv", "zero-bubble", "dualpipev"])
def test_plan_with_zero3_and_a_split_backward_schedule_is_one_error_line(run_main, schedule):
    argv = ["--world", "8", "--cluster", "h100-80gb", "--model", "llama3-8b", "--dp-mode", "zero3", "--schedule", schedule]
    code, out, err = run_main(plan_command.main, argv)
    assert code == 2 and out == ""
    assert err.startswith(f"error: --dp-mode zero3: --reshard-after-forward (ZeRO-3) cannot run with --schedule {schedule}")
    assert err.count("\n") == 1
