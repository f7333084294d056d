"""Launch processes from the commands (study, validate, calibrate) and the tests: a command in its
own process group with a timeout, and one study run (a real torchrun job, or the plain loop) with its figures.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProcessResult:
    returncode: int | None  # None when it timed out
    stdout: str
    stderr: str  # empty when stderr went to a file
    timed_out: bool


def run_process(cmd: list[str], *, timeout: float, env: dict | None = None, stderr_file=None) -> ProcessResult:
    """Run ``cmd`` from the project root in its own process group. On timeout the whole group is killed;
    in any case no process of the group survives the call (no stray ranks)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=stderr_file if stderr_file is not None else subprocess.PIPE,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, err = proc.communicate()
    finally:
        _kill_group(proc)
    return ProcessResult(None if timed_out else proc.returncode, out or "", err or "", timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class RunSpec:
    name: str  # unique; the run's folder under the study directory
    nproc: int
    args: list[str]  # run.py (or plain-loop) flags, without --logdir
    kind: str = "engine"  # "engine": torchrun run.py; "plain": python -m runtime.lab.plain_loop
    meta: dict = field(default_factory=dict)  # what the report needs to know: mesh, schedule, p, m, v, ...

    def argv(self, logdir: Path) -> list[str]:
        if self.kind == "plain" and self.nproc == 1:
            return [sys.executable, "-m", "runtime.lab.plain_loop", *self.args]
        if self.kind == "plain":  # DistributedDataParallel under torchrun
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                    "-m", "runtime.lab.plain_loop", *self.args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                str(ROOT / "run.py"), *self.args, "--logdir", str(logdir)]

    def display(self, logdir: Path) -> str:
        """The command as a user would type it (torchrun is ``python -m torch.distributed.run``)."""
        if self.kind == "plain" and self.nproc == 1:
            return "python -m runtime.lab.plain_loop " + shlex.join(self.args)
        if self.kind == "plain":
            return (f"torchrun --standalone --nproc_per_node={self.nproc} -m runtime.lab.plain_loop "
                    + shlex.join(self.args))
        return (f"torchrun --standalone --nproc_per_node={self.nproc} run.py " + shlex.join(self.args)
                + f" --logdir {shlex.quote(str(logdir))}")


@dataclass
class RunResult:
    name: str
    command: str
    ok: bool
    seconds: float
    summary: dict | None
    error: str | None
    out_of_memory: bool
    meta: dict

    def to_dict(self, meta: dict | None = None) -> dict:
        """The run's figures with ``meta`` (default: its own) saying what it stands for in the report."""
        summary = dict(self.summary or {})
        summary.pop("config", None)  # the command says it; keep results.json readable
        return {"name": self.name, "command": self.command, "ok": self.ok, "seconds": self.seconds,
                "summary": summary, "error": self.error, "out_of_memory": self.out_of_memory,
                **(self.meta if meta is None else meta)}


def execute(spec: RunSpec, study_dir: Path, *, timeout: float) -> RunResult:
    logdir = study_dir / spec.name
    logdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(logdir / "run.log", "w") as log:
        result = run_process(spec.argv(logdir), timeout=timeout, env={"OMP_NUM_THREADS": "1"}, stderr_file=log)
        log.write(result.stdout)
    seconds = time.monotonic() - start
    log_text = (logdir / "run.log").read_text(errors="replace")
    summary = _read_summary(spec, logdir, result.stdout) if result.returncode == 0 else None
    error = None
    if summary is None:
        error = f"timed out after {timeout:.0f}s" if result.timed_out else _last_error(log_text)
    return RunResult(spec.name, spec.display(logdir), summary is not None, seconds, summary, error,
                     out_of_memory="out of memory" in log_text.lower(), meta=spec.meta)


def _read_summary(spec: RunSpec, logdir: Path, stdout: str) -> dict | None:
    try:
        if spec.kind == "plain":
            return json.loads(stdout.strip().splitlines()[-1])
        return json.loads((logdir / "summary.json").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _last_error(log_text: str) -> str:
    lines = [line for line in log_text.splitlines() if "error" in line.lower()]
    return (lines[-1] if lines else log_text.strip().splitlines()[-1] if log_text.strip() else "failed")[:500]
