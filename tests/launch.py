"""Launch real multi-rank jobs from tests: torchrun subprocesses, or spawned ranks running a function.

Every wait has a timeout, and a rank that fails ends the whole job (and fails the test) instead of
leaving its peers blocked in a collective.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(cmd: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        _kill_group(proc)  # no stray ranks survive the test
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(args: list[str], *, nproc: int, timeout: float = 300, script: str = "run.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / script), *args]
    return run_command(cmd, timeout=timeout, env={"OMP_NUM_THREADS": "1"})


def python_run(args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_command([sys.executable, str(ROOT / "run.py"), *args], timeout=timeout)


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    try:
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # The rank's work and checks are done. Skip interpreter finalization: gloo's worker threads can
    # still hold tensors then, and releasing them without a live interpreter aborts the process
    # ("terminate called without an active exception", SIGABRT; pytorch/pytorch PR 179291), which we
    # saw once in CI after a test had passed on every rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], *, world_size: int, args: tuple = (), timeout: float = 300) -> None:
    """Run ``fn(*args)`` on ``world_size`` fresh processes forming one gloo job (env:// rendezvous)."""
    from runtime.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args, errors), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        timed_out = any(p.is_alive() for p in procs) and not failed
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    messages = []
    while not errors.empty():
        rank, tb = errors.get()
        messages.append(f"--- rank {rank} ---\n{tb}")
    if timed_out:
        raise AssertionError(f"ranks did not finish within {timeout}s\n" + "\n".join(messages))
    if failed:
        raise AssertionError(f"ranks failed (rank, exit code): {failed}\n" + "\n".join(messages))


def check_clean_failure(nproc: int, flags: list[str], words: list[str], *, max_seconds: float = 45) -> str:
    """Run ``flags`` on ``nproc`` ranks and expect a clean failure: a non-zero exit within ``max_seconds``,
    exactly one ``error:`` line containing every word, and no traceback through our code. Returns the line."""
    start = time.monotonic()
    result = torchrun(flags, nproc=nproc, timeout=max_seconds + 15)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    ours = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(ours) == 1, f"expected exactly one error line, got {ours}\n{result.stderr[-2000:]}"
    for word in words:
        assert word in ours[0], f"{word!r} not in {ours[0]!r}"
    # torchrun adds its own failure report; no rank may crash with a traceback through our code.
    for ours_path in ("run.py", "runtime/", "compiler/", "models/"):
        assert f'File "{ROOT / ours_path}' not in result.stdout + result.stderr
    assert elapsed < max_seconds, f"took {elapsed:.0f}s to fail"
    return ours[0]
