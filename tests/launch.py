"""Launch real multi-rank jobs from tests: torchrun subprocesses, or spawned ranks running a function.

Every wait has a timeout, and a rank that fails ends the whole job (and fails the test) instead of
leaving its peers blocked in a collective. The launchers are the product's own
(runtime/commands/launch.py, runtime/distributed/spawn.py); here they fail the test instead of raising.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from runtime.commands.launch import run_process
from runtime.distributed import spawn

ROOT = Path(__file__).resolve().parent.parent


def run_command(cmd: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail."""
    result = run_process(cmd, timeout=timeout, env=env)
    if result.timed_out:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{result.stdout[-3000:]}\n"
                             f"stderr:\n{result.stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, result.returncode, result.stdout, result.stderr)


def torchrun(args: list[str], *, nproc: int, timeout: float = 300, script: str = "run.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / script), *args]
    return run_command(cmd, timeout=timeout, env={"OMP_NUM_THREADS": "1"})


def python_run(args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_command([sys.executable, str(ROOT / "run.py"), *args], timeout=timeout)


def spawn_ranks(fn: Callable[..., Any], *, world_size: int, args: tuple = (), timeout: float = 300) -> None:
    """Run ``fn(*args)`` on ``world_size`` fresh processes forming one gloo job (env:// rendezvous)."""
    try:
        spawn.spawn_ranks(fn, world_size=world_size, args=args, timeout=timeout)
    except spawn.SpawnError as e:
        raise AssertionError(str(e)) from None


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
