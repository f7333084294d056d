"""The study's runner (study/runner.py): each run once, identical runs of two sections shared, a failed run
tried again, results saved after every run, a progress line per run. The runs are faked."""

import json

from runtime.commands.launch import RunResult, RunSpec
from runtime.lab.study.runner import StudyRunner, samples_per_sec


class FakeExecute:
    """Stands for launch.execute: records what it was asked to run; runs named in ``failing`` fail."""

    def __init__(self, failing=()):
        self.calls, self.failing = [], set(failing)

    def __call__(self, spec, study_dir, *, timeout):
        self.calls.append((spec.name, timeout))
        ok = spec.name not in self.failing
        return RunResult(spec.name, f"run.py {' '.join(spec.args)}", ok, 2.0,
                         {"samples_per_sec": 3.25} if ok else None, None if ok else "boom", False, spec.meta)


def _runner(tmp_path, execute):
    results = {"commands": []}
    return results, StudyRunner(tmp_path, results, timeout_s=60, expected_runs=3, execute_run=execute)


def test_an_identical_run_of_another_section_is_reused_under_its_own_meta(tmp_path, capsys):
    execute = FakeExecute()
    results, runner = _runner(tmp_path, execute)
    first = runner.run(RunSpec("throughput_a", 2, ["--pp", "2"], meta={"section": "throughput", "label": "a"}),
                       samples_per_sec)
    second = runner.run(RunSpec("scaling_b", 2, ["--pp", "2"], meta={"section": "scaling", "kind": "PP"}),
                        samples_per_sec)
    assert execute.calls == [("throughput_a", 60)]
    assert first["ok"] and first["label"] == "a" and "reused_from" not in first
    assert second["reused_from"] == "throughput_a" and second["kind"] == "PP" and "label" not in second
    assert second["summary"] == first["summary"]
    out = capsys.readouterr().out
    assert "[1/~3] throughput_a: 3.250 samples/s (2s" in out and "[reused] scaling_b" in out
    assert results["commands"] == ["run.py --pp 2"]


def test_a_repetition_and_a_failed_run_are_run_again(tmp_path, capsys):
    execute = FakeExecute(failing={"x_r0"})
    _, runner = _runner(tmp_path, execute)
    failed = runner.run(RunSpec("x_r0", 1, ["--steps", "3"]), samples_per_sec)
    retried = runner.run(RunSpec("x_again", 1, ["--steps", "3"]), samples_per_sec)
    runner.run(RunSpec("x_r1", 1, ["--steps", "3"], meta={"round": 1}), samples_per_sec)
    assert [name for name, _ in execute.calls] == ["x_r0", "x_again", "x_r1"]
    assert not failed["ok"] and failed["error"] == "boom" and retried["ok"]
    assert "x_r0: FAILED: boom" in capsys.readouterr().out


def test_results_are_saved_after_every_run(tmp_path):
    results, runner = _runner(tmp_path, FakeExecute())
    results["section"] = {"partial": True}
    runner.run(RunSpec("one", 1, ["--steps", "1"]), samples_per_sec)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == {"commands": ["run.py --steps 1"], "section": {"partial": True}}
