"""The speed probe re-runs calibration's recorded engine runs and returns how much slower they run now.

The runs themselves are replaced by a stand-in for ``execute`` that reports chosen step times, so the
test checks the arithmetic and the checks on the recorded set, not this machine's speed.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from compiler.planner.cluster import load_cluster
from runtime.commands.flag_table import plan_flags
from runtime.lab import speed_probe
from runtime.lab.calibrate_engine import calibration_runs


def _recorded(world: int = 4) -> list[dict]:
    return [{"plan": plan.describe(), "measured_s": 0.1 * (i + 1)} for i, (_, plan) in enumerate(calibration_runs(world))]


def _cluster(runs: list[dict], world: int = 4):
    base = load_cluster("cpu-2core")
    return dataclasses.replace(base, notes={**base.notes, "engine_fit": {"world": world, "runs": runs}})


def test_probe_is_the_geometric_mean_of_now_over_then(monkeypatch):
    runs = _recorded()
    slower = dict(zip(speed_probe.PROBE_RUNS, (2.0, 0.5 * 4)))  # run -> now / then
    seen = []

    def fake_execute(spec, study_dir, *, timeout):
        i = int(spec.name.split("_")[1])
        seen.append((i, spec.nproc, spec.args))
        return SimpleNamespace(ok=True, summary={"step_time_s": runs[i]["measured_s"] * slower[i]})

    monkeypatch.setattr(speed_probe, "execute", fake_execute)
    ratio, line = speed_probe.probe(_cluster(runs))
    assert ratio == pytest.approx(math.sqrt(2.0 * 2.0))
    assert "2.00x" in line
    # The probe re-runs exactly calibration's plans on calibration's number of ranks.
    model, plan = calibration_runs(4)[speed_probe.PROBE_RUNS[1]]
    assert [(i, n) for i, n, _ in seen] == [(i, 4) for i in speed_probe.PROBE_RUNS]
    assert all(flag in seen[1][2] for flag in plan_flags(plan))


def test_probe_declines_without_a_comparable_calibration(monkeypatch):
    monkeypatch.setattr(speed_probe, "execute", lambda *a, **k: pytest.fail("must not run"))
    base = load_cluster("cpu-2core")
    assert speed_probe.probe(dataclasses.replace(base, notes={})) is None
    other_set = _recorded()[::-1]  # recorded with a different calibration set
    assert speed_probe.probe(_cluster(other_set)) is None


def test_probe_declines_when_a_run_fails(monkeypatch):
    monkeypatch.setattr(speed_probe, "execute", lambda *a, **k: SimpleNamespace(ok=False, summary=None))
    assert speed_probe.probe(_cluster(_recorded())) is None
