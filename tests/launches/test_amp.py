"""fp16 loss scaling across stages: an overflow on one rank makes every rank skip and back off together."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.launch import QUICK_RUN, spawn_ranks
from tests.step_hook import after_backward

pytestmark = pytest.mark.slow  # real multi-process jobs
INJECT_STEP = 1
# The rank whose gradient overflows: not rank 0, and not the one computing the loss. Rank 5 = dp 1, pp 0,
# mp 1 (looped placement: pp 0 holds the first stages); under zbv's V, pp 0 also holds the last stage, so
# rank 7 = dp 1, pp 1, mp 1 (the middle stages, run with split input- and weight-gradient passes).
INJECT_RANK = {"interleaved-1f1b": 5, "zbv": 7}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _inject_and_record(out_dir: str, inject_rank: int, step: int, ctx) -> None:
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
    if step == INJECT_STEP and rank == inject_rank:
        with torch.no_grad():
            _local(params[3].grad).view(-1)[0] = float("inf")


def _train(argv, out_dir, inject_rank):
    import run

    after_backward(functools.partial(_inject_and_record, out_dir, inject_rank))
    assert run.main(argv) == 0


def _argv(logdir, schedule: str) -> list[str]:
    return ["--dp=2", "--pp=2", "--mp=2", "--schedule", schedule, "--model", "tiny", "--precision", "fp16", "--steps", "4",
            "--micro-batch-size", "2", "--seq-len", "32", "--logdir", str(logdir), "--log-every", "1", *QUICK_RUN]


def _records(out_dir):
    return lambda rank, step: json.loads((out_dir / f"rank{rank}_step{step}.json").read_text())


@pytest.mark.parametrize("schedule", list(INJECT_RANK))
def test_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(tmp_path, schedule):
    spawn_ranks(_train, world_size=8, args=(_argv(tmp_path, schedule), str(tmp_path), INJECT_RANK[schedule]), timeout=300)
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
