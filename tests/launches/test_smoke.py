"""The CI smoke test: 8 simulated ranks, 2x2x2, fp16, 30 steps on the built-in text."""

from __future__ import annotations

import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runtime.observe.metrics import SCALAR_TAGS
from tests.launch import torchrun

pytestmark = pytest.mark.slow  # real multi-process jobs

def test_3d_fp16_training_on_8_ranks(tmp_path):
    result = torchrun(["--dp", "2", "--pp", "2", "--mp", "2", "--model", "tiny", "--precision", "fp16",
                       "--steps", "30", "--logdir", str(tmp_path)], nproc=8, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "MP groups: [0, 1] [2, 3] [4, 5] [6, 7]" in result.stdout
    assert "step 30/30 | loss" in result.stdout and "| epoch 0." in result.stdout
    assert "returned a view tensor" not in result.stderr  # FSDP's warning about the head's logits (tensor_parallel.py)

    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = summary["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    for key in ("final_loss", "samples_per_sec", "tokens_per_sec", "mfu", "peak_bytes", "skipped_steps", "config"):
        assert key in summary
    assert {k: summary["config"]["plan"][k] for k in ("dp", "pp", "mp", "cp", "ep")} == {"dp": 2, "pp": 2, "mp": 2,
                                                                                         "cp": 1, "ep": 1}

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(SCALAR_TAGS) <= tags, f"missing scalars: {set(SCALAR_TAGS) - tags}"
    assert len(events.Scalars("train/loss")) == 30
    assert all(e.value > 0 for e in events.Scalars("mem/peak_bytes"))
    assert "config" in "".join(events.Tags()["tensors"])  # the run configuration as text
