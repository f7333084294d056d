"""A rank that stops responding (SIGSTOP: a stuck device, a paused process) must not hang the job: every
other rank gives up after the timeout of the phase it is in (``--collective-timeout`` in steady steps,
``--startup-timeout``, ``--checkpoint-timeout``), says where in one line naming the phase, and the job ends."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from runtime.distributed.failures import PEER_FAILURE_EXIT_CODE
from tests.launch import TorchrunJob, alive, spawn_ranks

pytestmark = pytest.mark.slow  # real multi-process jobs

STOPPED_RANK = 3  # dp 0, pp 1, mp 1


def test_a_stopped_rank_ends_the_job_with_one_line_per_rank(tmp_path):
    args = ["--dp=2", "--pp=2", "--mp=2", "--model", "tiny", "--precision", "fp32", "--micro-batch-size", "2",
            "--seq-len", "32", "--steps", "500", "--eval-every", "0", "--peak-tflops", "1", "--log-every", "1",
            # start-up (tracing, the first step) may take long on 8 ranks of a busy machine; steps do not
            "--startup-timeout", "600", "--collective-timeout", "8", "--logdir", str(tmp_path / "log")]
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
    timed_out = [line for line in lines if "timed out after 8 s in steady steps (--collective-timeout 8: " in line]
    assert timed_out, output[-4000:]
    assert all(re.search(r"in steady steps .*, in step \d+, during .*; waiting on ", line) for line in lines), lines
    assert f"exitcode  : {PEER_FAILURE_EXIT_CODE}" in output
    # No gloo traceback through our code.
    assert "Traceback" not in "\n".join(line for line in output.splitlines() if "[rank" in line and "error:" not in line)


# --- each phase's own timeout: a rank late in start-up or in a checkpoint save ------------------------------

def _train_with_a_late_rank(argv: list[str], out_dir: str, late_in: str) -> None:
    """One spawned rank of a 2-rank pipeline, trained as run.py trains it. Rank 1 stalls in ``late_in``
    (building its stages: start-up; its second step: steady steps; writing a checkpoint: checkpoint I/O) until
    rank 0 has given up on it; each rank records the error line run.py would print (rank 0: the timeout;
    rank 1: its lost peer)."""
    from pathlib import Path

    import runtime.checkpoint.saving as saving
    import runtime.engine.build as build_module
    import runtime.engine.loop as loop
    from runtime.commands.train import check_inputs, train
    from runtime.device import select_device
    from runtime.distributed.failures import describe_peer_failure
    from runtime.distributed.mesh import GridLayout
    from runtime.distributed.process_group import LaunchEnv, init_distributed

    env = LaunchEnv.from_environ()
    cfg, data, start = check_inputs(argv, env)
    device = select_device(env.local_rank, cfg.device)
    init_distributed(env, device, timeout_s=cfg.startup_timeout_s)
    given_up = Path(out_dir, "rank0.txt")

    def late(fn, *, on_call: int = 1):
        calls = []

        def wait_then_run(*args, **kwargs):
            calls.append(1)
            deadline = time.monotonic() + 90
            while len(calls) == on_call and not given_up.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return fn(*args, **kwargs)
        return wait_then_run

    if env.rank == 1:
        owner, name, on_call = {"start-up": (build_module, "build_local_stages", 1), "steady": (loop, "train_step", 2),
                                "checkpoint": (saving, "begin_save", 1)}[late_in]
        setattr(owner, name, late(getattr(owner, name), on_call=on_call))
    try:
        train(cfg, data, start, env=env, device=device)
        line = "trained to the end"
    except RuntimeError as e:
        line = describe_peer_failure(e, rank=env.rank, layout=GridLayout(cfg.plan.dp, cfg.plan.pp, cfg.plan.mp),
                                     timeouts=cfg.timeouts) or f"not a peer failure: {e}"
    Path(out_dir, f"rank{env.rank}.txt").write_text(line)


@pytest.mark.parametrize("late_in, timeouts, expected", [
    # the other phases' bounds are long: only the phase's own can end the wait within the test's time
    ("start-up", ["--startup-timeout", "3", "--collective-timeout", "600", "--checkpoint-timeout", "600"],
     "timed out after 3 s in start-up (--startup-timeout 3: process groups, tracing, --compile, the first step"),
    # the pipeline's receives: gloo keeps the bound a group connected with (start-up's) unless the wait is given one
    ("steady", ["--startup-timeout", "600", "--collective-timeout", "3", "--checkpoint-timeout", "600"],
     "recv timed out after 3 s in steady steps (--collective-timeout 3: every later step and validation), in step 2, "
     "during the pipeline schedule"),
    ("checkpoint", ["--startup-timeout", "600", "--collective-timeout", "600", "--checkpoint-timeout", "3"],
     "timed out after 3 s in checkpoint I/O (--checkpoint-timeout 3: saving, publishing and loading checkpoints), "
     "in step 1, during saving a checkpoint; waiting on all 2 ranks"),
])
def test_a_rank_late_in_a_phase_is_given_up_on_after_that_phases_own_timeout(tmp_path, late_in, timeouts, expected):
    argv = ["--pp", "2", "--model", "tiny", "--precision", "fp32", "--micro-batch-size", "2", "--seq-len", "32",
            "--steps", "2" if late_in == "steady" else "1", "--eval-every", "0", "--peak-tflops", "1", "--data", "synthetic",
            "--device", "cpu",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--logdir", str(tmp_path / "log"), *timeouts]
    started = time.monotonic()
    spawn_ranks(_train_with_a_late_rank, world_size=2, args=(argv, str(tmp_path), late_in), timeout=150)
    elapsed = time.monotonic() - started
    given_up = (tmp_path / "rank0.txt").read_text()
    assert given_up.startswith("rank 0: ") and expected in given_up, given_up
    assert "a peer rank closed its connection" in (tmp_path / "rank1.txt").read_text()
    assert elapsed < 90, f"{elapsed:.0f} s"
