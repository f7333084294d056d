"""A rank that stops responding (SIGSTOP: a stuck device, a paused process) must not hang the job: with
``--collective-timeout`` every other rank gives up, says where in one line, and the job ends."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from runtime.distributed.failures import PEER_FAILURE_EXIT_CODE
from tests.launch import TorchrunJob, alive

pytestmark = pytest.mark.slow  # real multi-process jobs

STOPPED_RANK = 3  # dp 0, pp 1, mp 1


def test_a_stopped_rank_ends_the_job_with_one_line_per_rank(tmp_path):
    args = ["--dp=2", "--pp=2", "--mp=2", "--model", "tiny", "--precision", "fp32", "--micro-batch-size", "2",
            "--seq-len", "32", "--steps", "500", "--eval-every", "0", "--peak-tflops", "1", "--log-every", "1",
            "--collective-timeout", "30", "--logdir", str(tmp_path / "log")]
    with TorchrunJob(args, nproc=8, log=tmp_path / "output.txt") as job:
        job.wait_for(r"step\s+3/500 \|", timeout=240)
        workers = job.workers()
        os.kill(workers[STOPPED_RANK], signal.SIGSTOP)
        stopped = time.monotonic()
        code = job.wait(timeout=180)
        while [pid for pid in workers.values() if alive(pid)] and time.monotonic() - stopped < 180:
            time.sleep(0.2)
        elapsed = time.monotonic() - stopped
        output = job.output()
    assert code != 0
    assert not [pid for pid in workers.values() if alive(pid)], "a rank outlived the job"
    assert elapsed < 150, f"took {elapsed:.0f}s to end after rank {STOPPED_RANK} stopped"
    lines = re.findall(r"^(?:\[rank\d\]:)?error: (rank \d: .*)$", output, re.MULTILINE)
    timed_out = [line for line in lines if "timed out after 30 s (--collective-timeout 30)" in line]
    assert timed_out, output[-4000:]
    assert all(re.search(r"in step \d+, during .*; waiting on ", line) for line in lines), lines
    assert f"exitcode  : {PEER_FAILURE_EXIT_CODE}" in output
    # No gloo traceback through our code.
    assert "Traceback" not in "\n".join(line for line in output.splitlines() if "[rank" in line and "error:" not in line)
