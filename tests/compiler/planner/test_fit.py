"""The time model's engine factors: the fit recovers known factors, never goes negative, and the
planner's step time is exactly the fitted combination of its terms."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from compiler.planner.auto import rank_plans
from compiler.planner.cluster import EngineFactors, load_cluster
from compiler.planner.fit import FACTORS, fit_factors
from compiler.planner.search import price
from compiler.planner.shape import DecoderShape
from compiler.planner.step import StepTerms
from models import MODEL_NAMES, named_config
from runtime.commands.flags import default_config, parse_train_config
from runtime.config import plan_checker


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
    cluster = base.with_factors(compute_scale=1.3, comm_scale=2.5, dp_comm_scale=3.5, action_overhead=0.003,
                                step_overhead=0.05)
    for e in rank_plans(named_config("tiny"), validate=plan_checker(default_config(named_config("tiny"))), world=4,
                        global_batch_size=16, cluster=cluster,
                         precisions=("fp32", "bf16"))[:40]:
        if e.feasible:
            assert e.step_time == pytest.approx(e.terms.combine(cluster.factors), rel=1e-12)
            assert e.breakdown.step == pytest.approx(sum(e.breakdown.to_dict().values()), rel=1e-12)


def test_calibration_plans_are_valid_and_use_models_the_validation_does_not():
    from runtime.lab.calibrate_engine import calibration_runs, predicted_terms
    from runtime.lab.validate import MODELS

    cluster = load_cluster("cpu-2core")
    runs = calibration_runs(4)
    assert len(runs) > len(FACTORS)  # overdetermined: the fit error means something
    meshes = {(c.dp > 1, c.pp > 1, c.mp > 1) for _, c in runs}
    assert {(True, False, False), (False, True, False), (False, False, True)} <= meshes  # DP, PP and TP alone
    for model, plan in runs:
        assert model not in [c for _, c in MODEL_NAMES.values()]  # explicit shapes, none of the named models validation uses
        terms = predicted_terms(model, plan, cluster)  # raises if the engine would refuse the plan
        assert terms.compute > 0 and terms.actions >= 2
    assert {g.name for g in MODELS} == {"tiny", "small", "mixtral-debug", "llama3-debug"}
    assert not {model for model, _ in runs} & {g.model() for g in MODELS}  # fitted on other shapes than validated
    assert all(plan.dp * plan.pp * plan.mp == 8 for _, plan in calibration_runs(8))
    two = calibration_runs(2)  # 2 ranks on 2 cores: each 4-rank plan with one dimension halved
    assert [model for model, _ in two] == [model for model, _ in runs]
    assert all(plan.dp * plan.pp * plan.mp == 2 for _, plan in two)
    assert {(c.dp > 1, c.pp > 1, c.mp > 1) for _, c in two} == {(True, False, False), (False, True, False),
                                                                (False, False, True)}
    assert {c.schedule for _, c in two} == {c.schedule for _, c in runs}
    for model, plan in two:
        assert predicted_terms(model, plan, cluster).compute > 0  # raises if the engine would refuse the plan
    with pytest.raises(ValueError, match="2 or a multiple of 4"):
        calibration_runs(6)


def test_refit_recovers_factors_from_recorded_runs_and_refuses_foreign_records():
    from runtime.lab.calibrate_engine import calibration_runs, predicted_terms, refit_engine

    base = load_cluster("cpu-2core")
    truth = {"compute_scale": 1.4, "comm_scale": 2.2, "dp_comm_scale": 3.0, "action_overhead": 0.002,
             "step_overhead": 0.03}
    runs = calibration_runs(4)
    rows = [{"plan": plan.describe(), "measured_s": _combine(predicted_terms(model, plan, base), truth)}
            for model, plan in runs]
    recorded = dataclasses.replace(base, notes={**base.notes, "engine_fit": {"world": 4, "runs": rows}})
    base = base.with_factors(compute_scale=1.0, comm_scale=1.0, dp_comm_scale=1.0, action_overhead=0.0,
                             step_overhead=0.0)
    refitted = refit_engine(base, recorded)
    for name in FACTORS:
        assert getattr(refitted.factors, name) == pytest.approx(truth[name], rel=1e-6)
    assert "8 engine runs on 4 ranks" in refitted.source.split("; engine factors fitted to ")[1]
    foreign = dataclasses.replace(base, notes={"engine_fit": {"world": 4, "runs": rows[::-1]}})
    with pytest.raises(ValueError, match="not the current calibration set"):
        refit_engine(base, foreign)
    with pytest.raises(ValueError, match="no recorded engine runs"):
        refit_engine(base, dataclasses.replace(base, notes={}))


def test_a_fit_at_a_second_world_is_kept_beside_the_first_and_prices_plans_near_it(tmp_path):
    """Ranks that share cores slow collectives more than kernels (this machine: TP / PP x1.8 at 4 ranks, x5.1
    at 8): calibrating at 8 ranks keeps the 4-rank fit, each plan is priced with the nearer world's factors,
    the table survives the file, and a refit recovers both worlds from their recorded runs."""
    from runtime.lab.calibrate_engine import calibration_runs, predicted_terms, refit_engine, with_fitted_factors

    base = dataclasses.replace(load_cluster("cpu-2core").with_factors(**dict.fromkeys(FACTORS, 1.0)), notes={},
                               source="kernels; engine factors fitted to 8 engine runs on 2 ranks (old); attention")
    truth = {4: {"compute_scale": 1.5, "comm_scale": 1.8, "dp_comm_scale": 3.7, "action_overhead": 0.001,
                 "step_overhead": 0.03},
             8: {"compute_scale": 1.2, "comm_scale": 5.0, "dp_comm_scale": 4.1, "action_overhead": 0.002,
                 "step_overhead": 0.08}}
    cluster = base
    for world in (4, 8):
        runs = calibration_runs(world)
        terms = [predicted_terms(model, plan, base) for model, plan in runs]
        rows = [{"plan": plan.describe(), "measured_s": _combine(t, truth[world])} for (_, plan), t in zip(runs, terms)]
        cluster = with_fitted_factors(cluster, world, rows, terms, [r["measured_s"] for r in rows])
    for world, near in ((1, 4), (4, 4), (5, 4), (6, 8), (8, 8), (64, 8)):
        assert dataclasses.asdict(cluster.factors_for(world)) == pytest.approx(truth[near], rel=1e-6), world
    assert cluster.source.startswith("kernels; attention; engine factors fitted to 8 engine runs on 4 ranks (")
    assert "8 engine runs on 8 ranks" in cluster.source and "2 ranks" not in cluster.source
    config = default_config(named_config("tiny"))
    for world in (4, 8):
        plan = next(e for e in rank_plans(config.model, validate=plan_checker(config), world=world, global_batch_size=16,
                                          cluster=cluster,
                                          precisions=("bf16",)) if e.feasible and e.plan.mp > 1)
        assert plan.step_time == pytest.approx(_combine(plan.terms, truth[world]), rel=1e-9)
    path = tmp_path / "cluster.json"
    path.write_text(cluster.to_json())
    again = load_cluster(str(path))
    assert again.factors_by_world == cluster.factors_by_world and again.to_json() == cluster.to_json()
    refitted = refit_engine(base, again)
    assert refitted.factors_by_world == pytest.approx(cluster.factors_by_world)
    assert refitted.notes["engine_fit"]["world"] == 8  # the latest fit stays the default
    assert not base.with_factors(compute_scale=2.0).factors_by_world  # one set of factors: every world
    bad = json.loads(cluster.to_json())
    bad["engine_factors_by_world"]["8"].pop("comm_scale")
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="cluster file cluster: engine_factors_by_world '8'"):
        load_cluster(str(path))


def test_a_few_runs_fit_only_the_factors_they_determine_the_rest_stay():
    """A lent GPU gives one or two runs: compute_scale alone is fitted, the other factors keep their values."""
    rng = random.Random(2)
    terms = [_terms(rng) for _ in range(2)]
    fixed = EngineFactors(compute_scale=1.0, comm_scale=1.5, dp_comm_scale=2.0, action_overhead=0.001,
                          step_overhead=0.02)
    truth = {**dataclasses.asdict(fixed), "compute_scale": 2.4}
    fit = fit_factors(terms, [_combine(t, truth) for t in terms], factors=("compute_scale",), fixed=fixed)
    assert fit.factors == pytest.approx(truth, rel=1e-9)
    with pytest.raises(ValueError, match="at least 2"):
        fit_factors(terms[:1], [1.0], factors=("compute_scale", "step_overhead"))


def test_measured_gpu_runs_refit_a_gpu_preset(tmp_path):
    """calibrate --measured: an engine summary (as tests/gpu/gpu_check.sh keeps it) refits the GPU preset's
    compute_scale so that the planner predicts the measured step; run.py validate --measured compares."""
    from compiler.planner.measured import compare, fit_to_runs, read_runs

    cfg = parse_train_config(["--model", "llama3-1b", "--seq-len", "2048", "--micro-batch-size", "4",
                              "--microbatches", "2", "--precision", "bf16"], world_size=1)
    h100 = load_cluster("h100-80gb")
    predicted = price(DecoderShape.from_config(cfg.model), cfg.plan, cluster=h100).step_time
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"engine1": {"config": cfg.to_dict(), "step_time_s": 1.3 * predicted,
                                               "peak_bytes": 50 * 2**30, "device": "NVIDIA H100 80GB HBM3"},
                                   "plain1": {"tokens_per_sec": 1.0}}))
    runs = read_runs(results)
    assert [r.name for r in runs] == ["engine1"] and runs[0].plan == cfg.plan
    fitted = fit_to_runs(h100, runs)
    assert fitted.factors.compute_scale > 1.0 and fitted.notes["engine_fit"]["factors"] == ["compute_scale"]
    (row,) = compare(runs, fitted)
    assert abs(row["error"]) < 1e-6 and row["predicted_peak_gib"] > 0


def test_a_study_folder_is_read_run_by_run_with_tensor_peaks_on_the_cpu(tmp_path):
    """run.py validate --measured DIR: every run folder's summary.json; a CPU run's peak is its --profile-memory
    tensor peak (its peak_bytes is the process's resident peak), a GPU run's max_memory_allocated."""
    from compiler.planner.measured import read_runs

    cfg = parse_train_config(["--model", "tiny", "--dp", "2", "--cp", "2"], world_size=4)
    runs = {"a_cpu": {"device": "AMD EPYC (2 cores)", "peak_bytes": 9e8, "peak_tensor_bytes": 1e8},
            "b_cpu_unprofiled": {"device": "AMD EPYC (2 cores)", "peak_bytes": 9e8},
            "c_gpu": {"device": "NVIDIA H100 80GB HBM3 (1 x cuda)", "peak_bytes": 5e9}}
    for name, fields in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"config": cfg.to_dict(), "step_time_s": 1.0, **fields}))
    got = read_runs(tmp_path)
    assert [(r.name, r.peak_bytes) for r in got] == [("a_cpu", 1e8), ("b_cpu_unprofiled", None), ("c_gpu", 5e9)]
    assert got[0].plan.cp == 2 and got[0].plan.dp == 2


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a JSON object is a summary or a results file; got a list"),
    ("nope", "not JSON (Expecting value"),
    (json.dumps({"a": {"config": {"mesh": {}}, "step_time_s": 1.0}}), "run 'a': its config is not an engine "
                                                                      "summary's (no 'model')"),
])
def test_a_malformed_measured_file_is_one_error_naming_it(tmp_path, text, message):
    from compiler.planner.measured import read_runs
    from runtime.lab import validate

    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=str(path)) as e:
        read_runs(path)
    assert message in str(e.value)
    assert validate.main(["--measured", str(path), "--cluster", "h100-80gb", "--out", str(tmp_path / "out.json")]) == 2


def test_validation_runs_plans_with_every_dimension_the_planner_prices():
    """run.py validate on 4 ranks: dense plans with and without SP, a mixture of experts' plans with ep > 1 and
    long sequences' plans with cp > 1, each the best of its mesh."""
    from runtime.lab.validate import MODELS

    cluster = load_cluster("cpu-2core")
    chosen = {}
    for group in MODELS:
        plans = [e.plan for e in rank_plans(group.model(), validate=plan_checker(default_config(group.model())), world=4,
                                            cluster=cluster,
                                                 global_batch_size=group.global_batch, max_cp=group.max_cp)
                 if e.feasible and group.keeps(e.plan)]
        chosen[group.name] = plans
        assert plans and all(c.dp * c.pp * c.mp * c.cp == 4 for c in plans)
    assert any(c.sequence_parallel for c in chosen["tiny"]) and any(c.mp > 1 and not c.sequence_parallel
                                                                   for c in chosen["tiny"])
    assert all(c.ep > 1 for c in chosen["mixtral-debug"]) and {c.ep for c in chosen["mixtral-debug"]} == {2, 4}
    assert all(c.cp > 1 for c in chosen["llama3-debug"]) and {c.cp for c in chosen["llama3-debug"]} == {2, 4}


def test_a_validation_summary_of_one_or_no_measured_run_prints_without_a_rank_correlation():
    """On 2 ranks the mixture of experts has one ep plan: no Spearman, and the summary line still prints."""
    from runtime.lab.validate import summarize, summary_line

    one = summarize([{"plan": "2x1x1 ep=2", "predicted_s": 0.24, "measured_s": 0.19}])
    assert one["spearman"] is None and one["mdape"] == pytest.approx(0.05 / 0.19)
    assert summary_line("mixtral-debug", one) == ("mixtral-debug: MdAPE 26.3%, Spearman n/a, predicted best within "
                                                  "10% of measured best: True (1 of 1 runs measured)")
    none = summarize([{"plan": "2x1x1", "predicted_s": 0.24, "measured_s": None}])
    assert summary_line("tiny", none).startswith("tiny: MdAPE n/a, Spearman n/a, predicted best within 10% of "
                                                 "measured best: False (0 of 1")


def _measure_tp_module(out: str) -> None:
    """One of two concurrent ranks: calibrate's DTensor cost per TP module on a mesh of itself alone."""
    import torch
    import torch.distributed as dist

    from runtime.lab.calibrate import own_process_mesh, tp_module_seconds

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seconds = tp_module_seconds(own_process_mesh(), "fp32", rounds=3)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seconds, f)
    dist.destroy_process_group()


def test_calibrate_measures_dtensors_cost_per_tensor_parallel_module_on_one_process_meshes(tmp_path):
    """Two processes at once, each timing a TP block on a mesh of itself (no collective to wait on): DTensor's
    dispatch adds ~0.8 ms per module and micro-batch here (fp32), several times the plain block's fixed cost;
    timing the plain block twice would give about 0."""
    from tests.launch import spawn_ranks

    spawn_ranks(_measure_tp_module, world_size=2, args=(str(tmp_path / "tp"),), timeout=240)
    for rank in range(2):
        seconds = json.loads((tmp_path / f"tp.{rank}").read_text())
        assert 1e-4 < seconds < 0.02
