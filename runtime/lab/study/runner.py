"""Runs the study's jobs one at a time: each run once (an identical run of two sections is shared), the
results saved after every run, a progress line per run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from runtime.atomic import write_json
from runtime.commands.launch import RunResult, RunSpec, execute
from runtime.lab.study.plan import run_key


class Progress:
    """``[done/~total] name: detail (seconds, minutes elapsed)``; the total is an estimate (the memory search
    decides its own trials)."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def report(self, result: RunResult, detail: str) -> None:
        self.done += 1
        status = detail if result.ok else f"FAILED: {result.error}"
        print(f"[{self.done}/~{self.total}] {result.name}: {status} ({result.seconds:.0f}s, "
              f"{(time.monotonic() - self.start) / 60:.1f} min elapsed)", flush=True)


class StudyRunner:
    """Executes run specs into ``results`` (the study's results.json, saved under ``out`` after every run;
    its "commands" list gets each executed run's command line)."""

    def __init__(self, out: Path, results: dict, *, timeout_s: float, expected_runs: int,
                 execute_run: Callable[..., RunResult] = execute):
        self.out, self.results, self.timeout_s = out, results, timeout_s
        self.progress = Progress(expected_runs)
        self._execute = execute_run
        self._finished: dict[tuple, RunResult] = {}  # run_key -> its result

    def run(self, spec: RunSpec, detail: Callable[[RunResult], str]) -> dict:
        """The run's record (RunResult.to_dict with the spec's meta); ``detail`` words a successful run's figures
        for the progress line. A spec whose run_key already ran successfully is not run again: its record is the
        earlier run's figures under this spec's meta, with "reused_from" naming that run."""
        key = run_key(spec)
        earlier = self._finished.get(key)
        if earlier is not None and earlier.ok:
            print(f"[reused] {spec.name}: the same run as {earlier.name}", flush=True)
            return {**earlier.to_dict(meta=spec.meta), "reused_from": earlier.name}
        result = self._execute(spec, self.out, timeout=self.timeout_s)
        self._finished[key] = result
        self.results["commands"].append(result.command)
        self.progress.report(result, detail(result) if result.ok else "")
        self.save()
        return result.to_dict()

    def save(self) -> None:
        write_json(self.out / "results.json", self.results, indent=2, default=str)


def samples_per_sec(result: RunResult) -> str:
    """The progress detail of a throughput run."""
    return f"{result.summary['samples_per_sec']:.3f} samples/s"


def tokens_per_sec(result: RunResult) -> str:
    return f"{result.summary['tokens_per_sec']:.0f} tokens/s"
