"""Checkpoints of --fp8 runs hold the fp32 master weights only (FP8 values live inside a step): a run resumes with
the same recipe exactly, with another or without --fp8, and an fp32 run's checkpoint resumes in FP8; ``export``
writes full-precision tensors. One spawned job of 2 ranks (dp 2, FSDP) runs every training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import python_run, train_runs
from tests.launches.test_checkpoint import _all_tensors

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

COMMON = ["--dp", "2", "--model", "tiny", "--precision", "fp32", "--steps", "4", "--micro-batch-size", "2",
          "--seq-len", "32", "--warmup-steps", "1", "--lr", "3e-3", "--log-every", "1", "--eval-every", "0",
          "--peak-tflops", "1"]
AG = ["--fp8", "tensorwise", "--fp8-all-gather"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("fp8_resume")
    plan = {  # name -> flags, in order (later runs resume earlier ones' checkpoints)
        "whole": ["--fp8", "tensorwise"],
        "first_half": ["--fp8", "tensorwise", "--stop-at-step", "2", "--checkpoint-dir", str(root / "fp8")],
        "same_recipe": ["--fp8", "tensorwise", "--resume-from", str(root / "fp8" / "step-000002")],
        "without_fp8": ["--resume-from", str(root / "fp8" / "step-000002")],
        "fp32_first_half": ["--stop-at-step", "2", "--checkpoint-dir", str(root / "fp32")],
        "into_fp8": ["--fp8", "rowwise", "--resume-from", str(root / "fp32" / "step-000002")],
        # --fp8-all-gather: the weights FSDP gathers in FP8 are fp32 shards wrapped in a tensor subclass, which
        # checkpoints must not see
        "ag_whole": [*AG],
        "ag_first_half": [*AG, "--stop-at-step", "2", "--checkpoint-dir", str(root / "ag")],
        "ag_resumed": [*AG, "--resume-from", str(root / "ag" / "step-000002")],
        "ag_resumed_gathering_in_fp32": ["--fp8", "tensorwise", "--resume-from", str(root / "ag" / "step-000002")],
    }
    train_runs([[*COMMON, "--logdir", str(root / name), *flags] for name, flags in plan.items()], world_size=2,
               outputs=[root / name / "output" for name in plan], timeout=600)
    return root, {name: json.loads((root / name / "summary.json").read_text()) for name in plan}


def test_fp8_checkpoints_hold_full_precision_weights_and_state(runs):
    root, _ = runs
    tensors = _all_tensors(root / "fp8" / "step-000002")
    assert tensors and {t.dtype for t in tensors.values()} <= {torch.float32, torch.int64}
    assert any(key.startswith("model.") for key in tensors)


def test_a_resumed_fp8_run_continues_exactly_with_its_recipe(runs):
    _, summary = runs
    assert summary["same_recipe"]["start_step"] == 2
    assert summary["same_recipe"]["losses"] == summary["whole"]["losses"][2:]


def test_a_run_resumes_without_fp8_and_an_fp32_checkpoint_resumes_in_fp8(runs):
    _, summary = runs
    assert summary["without_fp8"]["start_step"] == summary["into_fp8"]["start_step"] == 2
    fp8, plain = summary["same_recipe"]["losses"], summary["without_fp8"]["losses"]
    assert fp8 != plain  # the products ran in FP8 in one and not the other ...
    assert plain == pytest.approx(fp8, rel=0.02)  # ... from the same weights
    assert summary["into_fp8"]["config"]["plan"]["fp8"] == "rowwise"
    # it continues from the trained weights, not from the initial ones
    assert summary["into_fp8"]["losses"][0] < summary["fp32_first_half"]["losses"][0] - 0.1


def test_export_of_an_fp8_run_writes_full_precision_tensors(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "model.pt"
    result = python_run(["export", "--checkpoint", str(root / "fp8"), "--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    weights = torch.load(out, weights_only=True)
    assert weights and {t.dtype for t in weights.values()} == {torch.float32}


def test_fp8_all_gather_checkpoints_hold_fp32_weights_and_resume_exactly(runs):
    root, summary = runs
    tensors = _all_tensors(root / "ag" / "step-000002")
    assert any(key.startswith("model.") for key in tensors)
    assert {t.dtype for t in tensors.values()} <= {torch.float32, torch.int64}
    assert summary["ag_resumed"]["start_step"] == 2
    assert summary["ag_resumed"]["losses"] == summary["ag_whole"]["losses"][2:]
    # gathering in fp32 quantizes the same whole weights with the same scales: the same products, the same losses
    assert summary["ag_resumed_gathering_in_fp32"]["losses"] == summary["ag_whole"]["losses"][2:]
