"""A rank killed with SIGKILL mid-run: the job ends (non-zero, naming the rank) instead of hanging, the last
complete checkpoint is intact, and ``--resume`` continues from it (here on fewer ranks, as after losing a node)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from runtime.checkpoint.files import find_latest, verify_files
from tests.launch import QUICK_RUN, TorchrunJob, alive, torchrun

pytestmark = pytest.mark.slow  # real multi-process jobs
KILL_RANK = 5  # dp 1, pp 0, mp 1: neither rank 0 (DCP's coordinator) nor the logging rank
ARGS = ["--model", "tiny", "--precision", "fp32", "--micro-batch-size", "2", "--seq-len", "32",
        "--global-batch-size", "8", "--steps", "500", *QUICK_RUN, "--log-every", "1", "--checkpoint-every", "2"]


def test_sigkill_of_one_rank_ends_the_job_and_resume_continues(tmp_path):
    directory = tmp_path / "ckpt"
    args = ["--dp=2", "--pp=2", "--mp=2", *ARGS, "--checkpoint-dir", str(directory), "--logdir", str(tmp_path / "log")]
    with TorchrunJob(args, nproc=8, log=tmp_path / "output.txt") as job:
        deadline = time.monotonic() + 240
        while not (directory / "latest").exists():  # wait for the first published checkpoint
            assert job.agent.poll() is None, f"the job ended early:\n{job.output()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240s"
            time.sleep(0.2)
        workers = job.workers()
        assert sorted(workers) == list(range(8)), workers
        os.kill(workers[KILL_RANK], signal.SIGKILL)
        killed_at = time.monotonic()
        code = job.wait(timeout=120)
        elapsed = time.monotonic() - killed_at
        assert not [pid for pid in workers.values() if alive(pid)], "a rank outlived the job"
        output = job.output()
    assert code != 0
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after rank {KILL_RANK} died"
    # torchrun's failure report names the rank and the signal.
    assert re.search(rf"rank\s*: {KILL_RANK} \(local_rank: {KILL_RANK}\)\s*\n\s*exitcode\s*: -9", output), output[-3000:]
    assert "Signal 9 (SIGKILL)" in output

    info, _notes = find_latest(directory)  # a save cut short by the kill is passed over, never loaded
    assert info is not None and verify_files(info, sorted(info.files)) == []

    logdir = tmp_path / "resumed"
    result = torchrun(["--dp=1", "--pp=2", "--mp=1", *ARGS, "--checkpoint-dir", str(directory), "--resume",
                       "--stop-at-step", str(info.step + 1), "--logdir", str(logdir)], nproc=2, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {info.path} (step {info.step})" in result.stdout
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["start_step"] == info.step and len(summary["losses"]) == 1
