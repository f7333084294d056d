"""Divergence guards: the decision logic alone, then real ranks stopped by an injected NaN / overflow."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from runtime.checkpoint.files import read_checkpoint, verify_files
from runtime.engine.guards import DivergenceError, DivergenceGuard
from tests.launch import QUICK_RUN, spawn_ranks
from tests.step_hook import after_backward

NAN = float("nan")


def _unscaled(k=3):
    return DivergenceGuard(max_bad_steps=k, min_loss_scale=1.0, loss_scaling=False)


def _fp16(k=3, floor=1.0):
    return DivergenceGuard(max_bad_steps=k, min_loss_scale=floor, loss_scaling=True)


def test_k_consecutive_non_finite_steps_stop_and_name_the_step():
    guard = _unscaled(3)
    guard.observe(1, loss=2.0, grad_norm=1.0, skipped=False, loss_scale=1.0)
    guard.observe(2, loss=NAN, grad_norm=NAN, skipped=True, loss_scale=1.0)
    assert not guard.weights_trustworthy
    guard.observe(3, loss=2.0, grad_norm=math.inf, skipped=True, loss_scale=1.0)
    with pytest.raises(DivergenceError, match=r"at step 4: .* 3 consecutive step\(s\) \(steps 2-4"):
        guard.observe(4, loss=NAN, grad_norm=1.0, skipped=True, loss_scale=1.0)


def test_a_finite_step_resets_the_count():
    guard = _unscaled(2)
    for step in range(1, 20):
        bad = step % 2 == 0
        guard.observe(step, loss=NAN if bad else 1.0, grad_norm=1.0, skipped=bad, loss_scale=1.0)
    assert guard.weights_trustworthy


def test_fp16_tolerates_k_skips_and_stops_on_the_next():
    guard = _fp16(2, floor=1e-9)
    scale = 65536.0
    for step in (1, 2):
        scale /= 2
        guard.observe(step, loss=NAN, grad_norm=NAN, skipped=True, loss_scale=scale)
        assert guard.weights_trustworthy  # fp16 skips leave the weights untouched
    with pytest.raises(DivergenceError, match=r"at step 3: 3 consecutive fp16 steps skipped .* \(steps 1-3\)"):
        guard.observe(3, loss=NAN, grad_norm=NAN, skipped=True, loss_scale=scale / 2)


def test_fp16_scale_below_the_floor_stops():
    guard = _fp16(100, floor=1.0)
    guard.observe(1, loss=3.0, grad_norm=1.0, skipped=False, loss_scale=1.0)
    with pytest.raises(DivergenceError, match=r"at step 2: the fp16 loss scale fell to 0.5, below --min-loss-scale 1"):
        guard.observe(2, loss=3.0, grad_norm=NAN, skipped=True, loss_scale=0.5)


def test_state_round_trips():
    guard = _fp16(5)
    guard.observe(7, loss=NAN, grad_norm=NAN, skipped=True, loss_scale=8.0)
    restored = _fp16(5)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert (restored.streak, restored.streak_start) == (1, 7)


# --- real ranks -------------------------------------------------------------------------------------------

def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _poison_from(step_index: int, rank_to_poison: int, value: float, step: int, ctx) -> None:
    """after_backward hook: from ``step_index`` on, one gradient element on one rank becomes ``value``."""
    import torch.distributed as dist

    if step >= step_index and dist.get_rank() == rank_to_poison:
        with torch.no_grad():
            _local(ctx.stages.parameters()[0].grad).view(-1)[0] = value


def _train_expecting_failure(argv, out_dir, hook) -> None:
    import torch.distributed as dist  # noqa: F401  (run.main creates and destroys the group)

    import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        after_backward(hook)
        code = run.main(argv)
    import os

    with open(f"{out_dir}/rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"code": code, "stderr": err.getvalue()}, f)


def _argv(tmp_path, precision, *extra):
    return ["--dp=1", "--pp=2", "--mp=1", "--model", "tiny", "--precision", precision, "--steps", "10",
            "--micro-batch-size", "2", "--seq-len", "32", "--logdir", str(tmp_path / "logs"), "--log-every", "1",
            *QUICK_RUN, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", *extra]


def _results(tmp_path):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_injected_nan_stops_fp32_run_without_overwriting_the_last_good_checkpoint(tmp_path):
    # Steps 1-3 are clean (checkpoint at step 2); a NaN gradient from step 4 on; K = 2 stops at step 5.
    hook = functools.partial(_poison_from, 3, 1, NAN)
    spawn_ranks(_train_expecting_failure, world_size=2, timeout=240,
                args=(_argv(tmp_path, "fp32", "--max-bad-steps", "2"), str(tmp_path), hook))
    results = _results(tmp_path)
    assert [r["code"] for r in results] == [1, 1], results
    error = [line for line in results[0]["stderr"].splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "training diverged at step 5" in error[0] and "steps 4-5" in error[0], results[0]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["latest", "step-000002"]
    info = read_checkpoint(ckpt / "step-000002")  # the last good checkpoint is complete and unchanged
    assert info.step == 2 and verify_files(info, sorted(info.files)) == []


@pytest.mark.slow
def test_fp16_loss_scale_collapse_stops_the_run(tmp_path):
    # An inf gradient every step from step 2: the scale halves each step, 65536 -> 4096 < 8192 at step 5.
    hook = functools.partial(_poison_from, 1, 0, math.inf)
    spawn_ranks(_train_expecting_failure, world_size=2, timeout=240,
                args=(_argv(tmp_path, "fp16", "--min-loss-scale", "8192"), str(tmp_path), hook))
    results = _results(tmp_path)
    assert [r["code"] for r in results] == [1, 1], results
    assert "training diverged at step 5: the fp16 loss scale fell to 4096" in results[0]["stderr"], results[0]
    # Skipped fp16 steps leave the weights intact, so the step-4 checkpoint was written; none after.
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000004"
