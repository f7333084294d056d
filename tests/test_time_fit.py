"""The time model's engine factors: the fit recovers known factors, never goes negative, and the
planner's step time is exactly the fitted combination of its terms."""

from __future__ import annotations

import dataclasses
import random

import pytest

from compiler.planner.cluster import load_cluster
from compiler.planner.fit import FACTORS, fit_factors
from compiler.planner.time_model import StepTerms
from models import MODEL_NAMES, named_config
from runtime.commands.flags import default_config
from runtime.planning import rank_plans


def _terms(rng: random.Random) -> StepTerms:
    return StepTerms(compute=rng.uniform(0.01, 5), communication=rng.uniform(0, 2), fsdp=rng.choice([0, rng.uniform(0, 1)]),
                     actions=rng.choice([2, 4, 8, 16]), optimizer=rng.uniform(0, 0.05))


def _combine(t: StepTerms, f: dict) -> float:
    return (f["compute_scale"] * t.compute + f["comm_scale"] * t.communication + f["dp_comm_scale"] * t.fsdp
            + f["action_overhead"] * t.actions + t.optimizer + f["step_overhead"])


def test_fit_recovers_the_factors_that_generated_the_times():
    rng = random.Random(0)
    truth = {"compute_scale": 1.7, "comm_scale": 3.2, "dp_comm_scale": 4.5, "action_overhead": 0.004,
             "step_overhead": 0.06}
    terms = [_terms(rng) for _ in range(12)]
    fit = fit_factors(terms, [_combine(t, truth) for t in terms])
    for name in FACTORS:
        assert fit.factors[name] == pytest.approx(truth[name], rel=1e-6)
    assert max(abs(e) for e in fit.relative_errors) < 1e-9


def test_fit_keeps_factors_non_negative_and_is_the_best_such():
    rng = random.Random(1)
    terms = [_terms(rng) for _ in range(8)]
    # Communication makes steps *faster* here: unconstrained least squares would give it a negative factor.
    measured = [1.5 * t.compute - 0.5 * t.communication + 0.3 + t.optimizer for t in terms]
    measured = [max(m, 0.05) for m in measured]
    fit = fit_factors(terms, measured)
    assert all(v >= 0 for v in fit.factors.values())
    assert fit.factors["comm_scale"] == 0.0

    def loss(f):
        return sum(((_combine(t, f)) / m - 1) ** 2 for t, m in zip(terms, measured))

    best = loss(fit.factors)
    for _ in range(200):  # no random non-negative perturbation does better
        other = {k: max(0.0, v * rng.uniform(0.8, 1.2) + rng.uniform(-0.01, 0.01)) for k, v in fit.factors.items()}
        assert loss(other) >= best - 1e-12


def test_fit_needs_as_many_runs_as_factors():
    with pytest.raises(ValueError, match="at least 5"):
        fit_factors([StepTerms(1, 1, 0, 2, 0)] * 4, [1.0] * 4)


def test_step_time_is_the_calibrated_combination_of_its_terms():
    base = load_cluster("cpu-2core")
    cluster = dataclasses.replace(base, compute_scale=1.3, comm_scale=2.5, dp_comm_scale=3.5, action_overhead=0.003,
                                  step_overhead=0.05)
    for e in rank_plans(default_config(named_config("tiny")), world=4, global_batch_size=16, cluster=cluster,
                         precisions=("fp32", "bf16"))[:40]:
        if e.feasible:
            assert e.step_time == pytest.approx(e.terms.combine(cluster), rel=1e-12)
            b = e.breakdown
            assert b.step == pytest.approx(b.compute + b.tp_comm + b.pp_comm + b.bubble + b.dp_comm + b.optimizer + b.fixed)


def test_calibration_plans_are_valid_and_use_models_the_validation_does_not():
    from runtime.commands.calibrate_engine import calibration_runs, predicted_terms
    from runtime.commands.plan_validation import MODELS

    cluster = load_cluster("cpu-2core")
    runs = calibration_runs(4)
    assert len(runs) > len(FACTORS)  # overdetermined: the fit error means something
    meshes = {(c.dp > 1, c.pp > 1, c.mp > 1) for _, c in runs}
    assert {(True, False, False), (False, True, False), (False, False, True)} <= meshes  # DP, PP and TP alone
    for model, plan in runs:
        assert model not in [c for _, c in MODEL_NAMES.values()]  # explicit shapes, none of the named models validation uses
        terms = predicted_terms(model, plan, cluster)  # raises if the engine would refuse the plan
        assert terms.compute > 0 and terms.actions >= 2
    assert {m for m, _, _ in MODELS} == {"tiny", "small"}
    assert all(plan.dp * plan.pp * plan.mp == 8 for _, plan in calibration_runs(8))
    with pytest.raises(ValueError, match="multiple of 4"):
        calibration_runs(6)


def test_refit_recovers_factors_from_recorded_runs_and_refuses_foreign_records():
    from runtime.commands.calibrate_engine import calibration_runs, predicted_terms, refit_engine

    base = load_cluster("cpu-2core")
    truth = {"compute_scale": 1.4, "comm_scale": 2.2, "dp_comm_scale": 3.0, "action_overhead": 0.002,
             "step_overhead": 0.03}
    runs = calibration_runs(4)
    rows = [{"plan": plan.describe(), "measured_s": _combine(predicted_terms(model, plan, base), truth)}
            for model, plan in runs]
    recorded = dataclasses.replace(base, notes={**base.notes, "engine_fit": {"world": 4, "runs": rows}})
    refitted = refit_engine(base, recorded)
    for name in FACTORS:
        assert getattr(refitted, name) == pytest.approx(truth[name], rel=1e-6)
    assert "engine factors fitted to 8 engine runs on 4 ranks" in refitted.source
    foreign = dataclasses.replace(base, notes={"engine_fit": {"world": 4, "runs": rows[::-1]}})
    with pytest.raises(ValueError, match="not the current calibration set"):
        refit_engine(base, foreign)
    with pytest.raises(ValueError, match="no recorded engine runs"):
        refit_engine(base, dataclasses.replace(base, notes={}))
