"""Launch real multi-rank jobs from tests: torchrun subprocesses, or spawned ranks running a function.

Every wait has a timeout, and a rank that fails ends the whole job (and fails the test) instead of
leaving its peers blocked in a collective. The launchers are the product's own
(runtime/commands/launch.py, runtime/distributed/spawn.py); here they fail the test instead of raising.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from runtime.commands.launch import run_process
from runtime.commands.train import check_inputs, train
from runtime.device import configure_cpu_threads, select_device
from runtime.distributed import spawn
from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

ROOT = Path(__file__).resolve().parent.parent

# The flags every quick training run of the tests shares: no validation (a single batch where one is run) and MFU
# against a nominal 1 TFLOP/s, so that no run starts with the CPU's peak calibration.
QUICK_RUN = ["--eval-every", "0", "--eval-batches", "1", "--peak-tflops", "1"]


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


# Imported once by the fork server every spawned rank is forked from (runtime/distributed/spawn.py): what
# a rank imports anyway (torch, DTensor, FSDP, pipelining, the engine), which a fresh interpreter per rank
# would import again.
PRELOAD = ("tests.launch",)


def spawn_ranks(fn: Callable[..., Any], *, world_size: int, args: tuple = (), timeout: float = 300) -> None:
    """Run ``fn(*args)`` on ``world_size`` processes forming one gloo job (env:// rendezvous), forked from a
    server that imported the engine once."""
    try:
        spawn.spawn_ranks(fn, world_size=world_size, args=args, timeout=timeout, preload=PRELOAD)
    except spawn.SpawnError as e:
        raise AssertionError(str(e)) from None


def train_each(argvs: list[list[str]], outputs: list[str] | None = None) -> None:
    """One rank of a spawned job (``spawn_ranks``): join the process group once, then train every argv in
    turn the way run.py does (a launch of 8 ranks on 2 cores costs more than a tiny model's few steps).
    ``outputs``: per argv, a path prefix its stdout and stderr go to (``<prefix>.rank<r>``)."""
    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank, "cpu")
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device)
    for i, argv in enumerate(argvs):
        with _output_to(None if outputs is None else f"{outputs[i]}.rank{env.rank}"):
            cfg, data, start = check_inputs(argv, env)
            if env.rank == 0:  # as run.py prints them (resharding, --init-from)
                for note in start.notes:
                    print(note, flush=True)
            train(cfg, data, start, env=env, device=device)
    shutdown_distributed()


@contextlib.contextmanager
def _output_to(path: str | None):
    """Send this process's stdout and stderr (file descriptors 1 and 2: prints, logging, C++ warnings) to
    ``path`` for the block."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def train_runs(argvs: list[list[str]], *, world_size: int, outputs: list[Path], timeout: float = 300) -> list[str]:
    """Train each argv in turn on one spawned job of ``world_size`` ranks (forked from the fork server: no
    torchrun, no interpreter start per rank); returns each run's output, every rank's, in rank order."""
    for o in outputs:
        Path(o).parent.mkdir(parents=True, exist_ok=True)
    spawn_ranks(train_each, world_size=world_size, args=(argvs, [str(o) for o in outputs]), timeout=timeout)
    return ["".join(Path(f"{o}.rank{r}").read_text(errors="replace") for r in range(world_size)) for o in outputs]


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


class TorchrunJob:
    """A torchrun job running in the background, for tests that act on it mid-run (signals, kills).
    Use as a context manager: on exit every process of the job is killed (stopped ones included)."""

    def __init__(self, args: list[str], *, nproc: int, log: Path, torchrun_flags: tuple[str, ...] = ()):
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *torchrun_flags, str(ROOT / "run.py"), *args]
        with open(log, "w") as out:
            self.agent = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.seen: dict[int, int] = {}  # every worker ever seen: RANK -> pid

    def __enter__(self) -> "TorchrunJob":
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.seen.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agent.pid, signal.SIGKILL)
        self.agent.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, *, timeout: float) -> re.Match:
        """Block until the job's output matches ``pattern``; fail if the job ends or time runs out."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.output())):
            assert self.agent.poll() is None, f"the job ended before {pattern!r}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout}s:\n{self.output()[-3000:]}"
            time.sleep(0.2)
        return found

    def workers(self) -> dict[int, int]:
        """RANK -> pid of the agent's current worker processes (read from /proc)."""
        ranks = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.agent.pid:
                    continue
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
            except (OSError, IndexError, ValueError):
                continue
            if "RANK" in env:
                ranks[int(env["RANK"])] = int(entry.name)
        self.seen.update(ranks)
        return ranks

    def wait(self, *, timeout: float) -> int:
        return self.agent.wait(timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
