"""Runs that survive the cluster: a SIGTERM (a preemption notice) checkpoints the step reached and ends
every rank, and ``--resume`` under ``torchrun --max-restarts`` carries a job past a killed rank, both with
the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from runtime.checkpoint.files import find_latest
from runtime.engine.preemption import PREEMPTED_EXIT_CODE
from tests.launch import QUICK_RUN, TorchrunJob, alive, train_runs

pytestmark = pytest.mark.slow  # real multi-process jobs

STEPS = 20
MESH = ["--dp=2", "--pp=2", "--mp=2"]
ARGS = ["--model", "tiny", "--precision", "fp32", "--micro-batch-size", "2", "--seq-len", "32",
        "--global-batch-size", "8", "--steps", str(STEPS), *QUICK_RUN, "--log-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    logdir = tmp_path_factory.mktemp("uninterrupted")
    train_runs([[*MESH, *ARGS, "--logdir", str(logdir)]], world_size=8, outputs=[logdir / "output"])
    return json.loads((logdir / "summary.json").read_text())["losses"]


def _assert_continues_exactly(summary: dict, uninterrupted: list[float]) -> None:
    start = summary["start_step"]
    assert start > 0 and len(summary["losses"]) == STEPS - start
    for step, (got, want) in enumerate(zip(summary["losses"], uninterrupted[start:]), start=start + 1):
        assert abs(got - want) <= 1e-6, f"step {step}: {got} after the interruption vs {want} uninterrupted"


def test_sigterm_checkpoints_the_step_reached_and_resume_is_exact(tmp_path, uninterrupted):
    directory = tmp_path / "ckpt"
    # No periodic checkpoint: without the preemption save, everything would be lost.
    args = [*MESH, *ARGS, "--checkpoint-dir", str(directory), "--logdir", str(tmp_path / "log")]
    with TorchrunJob(args, nproc=8, log=tmp_path / "output.txt") as job:
        job.wait_for(r"step\s+7/20 \|", timeout=240)
        workers = job.workers()
        job.agent.send_signal(signal.SIGTERM)  # what SLURM or Kubernetes sends torchrun
        signalled = time.monotonic()
        job.wait(timeout=90)
        while [pid for pid in workers.values() if alive(pid)] and time.monotonic() - signalled < 90:
            time.sleep(0.2)
        elapsed = time.monotonic() - signalled
        output = job.output()
    assert not [pid for pid in workers.values() if alive(pid)], "a rank outlived the job"
    assert elapsed < 60, f"took {elapsed:.0f}s to stop after SIGTERM"
    info, _ = find_latest(directory)
    assert info is not None and info.step >= 7, output[-3000:]
    assert f"step {info.step}: stopping on a preemption signal; checkpoint saved" in output
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in output or "SIGTERM" in output

    logdir = tmp_path / "resumed"
    train_runs([[*MESH, *ARGS, "--checkpoint-dir", str(directory), "--resume", "--logdir", str(logdir)]],
               world_size=8, outputs=[logdir / "output"])
    _assert_continues_exactly(json.loads((logdir / "summary.json").read_text()), uninterrupted)


def test_a_killed_rank_is_restarted_by_torchrun_and_resume_continues_exactly(tmp_path, uninterrupted):
    directory, logdir = tmp_path / "ckpt", tmp_path / "log"
    # The same command line for the first attempt and the restart: --resume starts fresh when there is nothing.
    args = [*MESH, *ARGS, "--checkpoint-dir", str(directory), "--checkpoint-every", "5", "--resume",
            "--logdir", str(logdir)]
    with TorchrunJob(args, nproc=8, log=tmp_path / "output.txt", torchrun_flags=("--max-restarts", "1")) as job:
        job.wait_for(r"step\s+7/20 \|", timeout=240)
        os.kill(job.workers()[5], signal.SIGKILL)
        code = job.wait(timeout=300)
        output = job.output()
    assert code == 0, output[-3000:]
    assert "--resume: no complete checkpoint" in output and "resuming from" in output
    _assert_continues_exactly(json.loads((logdir / "summary.json").read_text()), uninterrupted)
