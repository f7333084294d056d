"""fp16 loss scaling across stages: an overflow on one rank makes every rank skip and back off together."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.launch import spawn_ranks
from tests.step_hook import after_backward

pytestmark = pytest.mark.slow  # real multi-process jobs
INJECT_STEP, INJECT_RANK = 1, 5  # rank 5 = dp 1, pp 0, mp 1: not the loss rank, not rank 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _inject_and_record(out_dir: str, step: int, ctx) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    params = ctx.stages.parameters()
    record = {
        "scale": ctx.scaler.get_scale(),
        # Parameters as they are before this step's update, i.e. after the previous step.
        "param_checksum": float(sum(_local(p).detach().double().sum() for p in params)),
    }
    with open(f"{out_dir}/rank{rank}_step{step}.json", "w") as f:
        json.dump(record, f)
    if step == INJECT_STEP and rank == INJECT_RANK:
        with torch.no_grad():
            _local(params[3].grad).view(-1)[0] = float("inf")


def _train(argv, out_dir):
    import run

    after_backward(functools.partial(_inject_and_record, out_dir))
    assert run.main(argv) == 0


def _argv(logdir) -> list[str]:
    return ["--dp=2", "--pp=2", "--mp=2", "--model", "tiny", "--precision", "fp16", "--steps", "4",
            "--micro-batch-size", "2", "--seq-len", "32", "--logdir", str(logdir), "--peak-tflops", "1",
            "--log-every", "1", "--eval-every", "0", "--eval-batches", "1"]


def _records(out_dir):
    return lambda rank, step: json.loads((out_dir / f"rank{rank}_step{step}.json").read_text())


def test_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(tmp_path):
    spawn_ranks(_train, world_size=8, args=(_argv(tmp_path), str(tmp_path)), timeout=300)
    record = _records(tmp_path)

    for rank in range(8):
        # Control: the step before the injection trains normally and keeps the scale.
        first, before = record(rank, INJECT_STEP - 1), record(rank, INJECT_STEP)
        assert before["scale"] == first["scale"] and before["param_checksum"] != first["param_checksum"]
        before, after, later = record(rank, INJECT_STEP), record(rank, INJECT_STEP + 1), record(rank, INJECT_STEP + 2)
        assert after["scale"] == before["scale"] / 2, f"rank {rank} did not halve its loss scale"
        assert after["param_checksum"] == before["param_checksum"], f"rank {rank} stepped on an overflowed gradient"
        assert later["param_checksum"] != after["param_checksum"], f"rank {rank} stopped training after the skip"
    # All ranks hold the same scale at every step.
    for step in range(4):
        assert len({record(rank, step)["scale"] for rank in range(8)}) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(summary["losses"])))
