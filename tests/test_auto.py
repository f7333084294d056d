"""--auto trains a real 4-rank job with the planner's best plan for that world size."""

from __future__ import annotations

import json

from runtime.commands.plan import auto_flags
from runtime.config import parse_train_config
from tests.launch import torchrun


def test_auto_runs_the_planners_pick_on_4_ranks(tmp_path):
    argv = ["--model", "tiny", "--steps", "2", "--precision", "fp32", "--data", "synthetic", "--eval-every", "0",
            "--eval-batches", "1", "--peak-tflops", "1", "--logdir", str(tmp_path)]
    flags, best = auto_flags(argv, world=4)
    expected = parse_train_config([*argv, *flags], world_size=4)

    result = torchrun(["--auto", *argv], nproc=4, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"auto plan: {best.candidate.describe()}" in result.stdout
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert config["mesh"] == {"dp": expected.mesh.dp, "pp": expected.mesh.pp, "mp": expected.mesh.mp}
    assert config["pipeline"]["schedule"] == best.candidate.schedule
    assert config["pipeline"]["micro_batch_size"] == best.candidate.micro_batch_size
    assert config["activation_checkpointing"] == best.candidate.activation_checkpointing
