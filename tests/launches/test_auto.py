"""--auto trains a real 4-rank job with the planner's best plan for that world size."""

from __future__ import annotations

import json

import pytest

from runtime.commands.auto import auto_config
from runtime.commands.flags import build_parser
from tests.launch import QUICK_RUN, torchrun

pytestmark = pytest.mark.slow  # real multi-process jobs

def test_auto_runs_the_planners_pick_on_4_ranks(tmp_path):
    argv = ["--model", "tiny", "--steps", "2", "--precision", "fp32", "--data", "synthetic", *QUICK_RUN,
            "--logdir", str(tmp_path)]
    expected, best, _ = auto_config(build_parser().parse_args(["--auto", *argv]), ["--auto", *argv], world=4)

    result = torchrun(["--auto", *argv], nproc=4, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"auto plan: {best.plan.describe()}" in result.stdout
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert config["plan"] == expected.to_dict()["plan"]
    assert (config["plan"]["schedule"], config["plan"]["micro_batch_size"]) == (best.plan.schedule, best.plan.micro_batch_size)
    assert config["plan"]["ac"] == best.plan.ac


def test_auto_keeps_what_the_user_gave_beside_it():
    """--auto --sequence-parallel plans with SP (so tensor parallelism), --cp with that context parallelism."""
    argv = ["--auto", "--model", "tiny", "--precision", "fp32", "--sequence-parallel", "--cp", "2"]
    cfg, best, notes = auto_config(build_parser().parse_args(argv), argv, world=4)
    assert cfg.plan.sequence_parallel and best.plan.sequence_parallel and cfg.plan.mp > 1 and cfg.plan.cp == 2
    assert any("holding sequence_parallel=True, cp=2" in n for n in notes)
