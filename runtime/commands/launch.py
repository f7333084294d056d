"""Launch one study run (a real torchrun training job, or the plain loop) and collect its figures."""

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


@dataclass
class RunSpec:
    name: str  # unique; the run's folder under the study directory
    nproc: int
    args: list[str]  # run.py (or plain-loop) flags, without --logdir
    kind: str = "engine"  # "engine": torchrun run.py; "plain": python -m runtime.commands.study.plain_loop
    meta: dict = field(default_factory=dict)  # what the report needs to know: mesh, schedule, p, m, v, ...

    def argv(self, logdir: Path) -> list[str]:
        if self.kind == "plain":
            return [sys.executable, "-m", "runtime.commands.study.plain_loop", *self.args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                str(ROOT / "run.py"), *self.args, "--logdir", str(logdir)]

    def display(self, logdir: Path) -> str:
        """The command as a user would type it (torchrun is ``python -m torch.distributed.run``)."""
        if self.kind == "plain":
            return "python -m runtime.commands.study.plain_loop " + shlex.join(self.args)
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(logdir / "run.log", "w") as log:
        proc = subprocess.Popen(spec.argv(logdir), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            timed_out = True
        log.write(stdout)
    seconds = time.monotonic() - start
    log_text = (logdir / "run.log").read_text(errors="replace")
    summary = _read_summary(spec, logdir, stdout) if proc.returncode == 0 and not timed_out else None
    error = None
    if summary is None:
        error = f"timed out after {timeout:.0f}s" if timed_out else _last_error(log_text)
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
