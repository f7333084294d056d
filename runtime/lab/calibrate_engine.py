"""Calibrate the time model's engine factors from short real training runs (``run.py calibrate``).

The micro-benchmarks of runtime/lab/calibrate.py price kernels and collectives in isolation. Here the
engine itself runs a few plans for a few steps on ``world`` ranks, and compiler/planner/fit.py fits
compute_scale, comm_scale, dp_comm_scale, action_overhead and step_overhead to the measured median
step times.

The calibration models are deliberately neither `tiny` nor `small` (the models `validate`
checks), so validation measures how the fitted model predicts plans and models it has not seen: one
light model whose steps are dominated by fixed costs, and one whose steps are dominated by compute.
Every mesh kind (DP, PP, TP, mixed) and the schedules with different action counts appear.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import tempfile
import time
from pathlib import Path

from compiler.parallel_plan import ParallelPlan
from compiler.planner.cluster import Cluster, EngineFactors
from compiler.planner.fit import fit_factors
from compiler.planner.search import price
from compiler.planner.shape import DecoderShape
from models import named_config
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import default_config, model_flags
from runtime.commands.launch import RunSpec, execute
from runtime.config import plan_error

LIGHT = named_config("tiny", n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=1024)
HEAVY = named_config("tiny", n_layers=6, d_model=384, n_heads=6, seq_len=128, vocab_size=8192)
# (model flags, plan) on 4 ranks: dp, pp, mp, schedule, v, m, micro-batch, precision, activation checkpointing.
RUNS_4 = (
    (LIGHT, ParallelPlan(dp=4, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=1, micro_batch_size=4,
                         precision="bf16")),
    (LIGHT, ParallelPlan(dp=1, pp=4, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=4, micro_batch_size=2,
                         precision="bf16")),
    (LIGHT, ParallelPlan(dp=1, pp=1, mp=4, schedule="1f1b", stages_per_rank=1, microbatches=1, micro_batch_size=8,
                         precision="bf16")),
    (LIGHT, ParallelPlan(dp=2, pp=2, mp=1, schedule="interleaved-1f1b", stages_per_rank=2, microbatches=2,
                         micro_batch_size=2, precision="bf16")),
    (HEAVY, ParallelPlan(dp=4, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=1, micro_batch_size=2,
                         precision="bf16")),
    (HEAVY, ParallelPlan(dp=1, pp=4, mp=1, schedule="gpipe", stages_per_rank=1, microbatches=4, micro_batch_size=2,
                         precision="bf16")),
    (HEAVY, ParallelPlan(dp=1, pp=2, mp=2, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=2,
                         precision="bf16")),
    (HEAVY, ParallelPlan(dp=2, pp=1, mp=2, schedule="1f1b", stages_per_rank=1, microbatches=1, micro_batch_size=2,
                         precision="fp32")),
)
RUN_FLAGS = ["--data", "synthetic", "--steps", "6", "--log-every", "6", "--eval-every", "0", "--eval-batches", "1",
             "--peak-tflops", "1"]


def calibration_runs(world: int) -> list[tuple[object, ParallelPlan]]:
    """The plans to run on ``world`` ranks: the 4-rank set with dp scaled to the world size; on 2 ranks each
    4-rank plan with one of its dimensions halved (dp first, then pp, then mp), so that every mesh kind and
    schedule still appears with 2 ranks on 2 cores, where no rank time-shares a core."""
    if world == 2:
        return [(model, _halved(c)) for model, c in RUNS_4]
    if world < 4 or world % 4:
        raise ValueError(f"--engine-world {world}: must be 2 or a multiple of 4 (or 0 to skip the engine runs)")
    return [(model, dataclasses.replace(c, dp=c.dp * world // 4)) for model, c in RUNS_4]


def _halved(plan: ParallelPlan) -> ParallelPlan:
    for dim in ("dp", "pp", "mp"):
        if getattr(plan, dim) > 1:
            return dataclasses.replace(plan, **{dim: getattr(plan, dim) // 2})
    raise ValueError(f"{plan.describe()} runs on one rank")


def predicted_terms(model, plan: ParallelPlan, cluster: Cluster):
    error = plan_error(default_config(model), plan)
    e = price(DecoderShape.from_config(model), plan, cluster=cluster)
    if error or not e.feasible:
        raise ValueError(f"calibration plan {plan.describe()} is infeasible: {error or e.reason}")
    return e.terms


def calibrate_engine(cluster: Cluster, *, world: int, timeout: float = 900) -> Cluster:
    """``cluster`` with its engine factors fitted to real runs on ``world`` ranks; runs and errors in notes."""
    runs = calibration_runs(world)
    terms, measured, rows = [], [], []
    with tempfile.TemporaryDirectory() as work:
        for i, (model, plan) in enumerate(runs, 1):
            spec = RunSpec(f"calibration_{i}", world, [*model_flags(model), *plan_flags(plan), *RUN_FLAGS])
            result = execute(spec, Path(work), timeout=timeout)
            if not result.ok:
                raise RuntimeError(f"calibration run failed: {result.command}: {result.error}")
            t = predicted_terms(model, plan, cluster)
            terms.append(t)
            measured.append(result.summary["step_time_s"])
            rows.append({"model": " ".join(model_flags(model)), "plan": plan.describe(), "measured_s": measured[-1],
                         "terms": dataclasses.asdict(t)})
            print(f"  [{i}/{len(runs)}] {plan.describe():<48} measured {measured[-1]:.3f} s/step", flush=True)
    return with_fitted_factors(cluster, world, rows, terms, measured)


def refit_engine(cluster: Cluster, recorded: Cluster) -> Cluster:
    """Refit ``cluster``'s engine factors to the runs ``recorded`` measured (no new runs), at every world it
    recorded: for a changed time model or new kernel rates. The recorded runs must be this module's current
    calibration set."""
    fits = recorded_fits(recorded)
    if not fits:
        raise ValueError(f"{recorded.name}: no recorded engine runs to refit (run calibrate without --refit)")
    latest = str(recorded.notes.get("engine_fit", {}).get("world"))
    for world in sorted(fits, key=lambda w: (w == latest, int(w))):  # the latest fit stays the default
        rows = [dict(r) for r in fits[world]["runs"]]
        runs = calibration_runs(int(world))
        if [r["plan"] for r in rows] != [plan.describe() for _, plan in runs]:
            raise ValueError(f"the engine runs recorded on {world} ranks are not the current calibration set; "
                             f"rerun calibrate")
        terms = [predicted_terms(model, plan, cluster) for model, plan in runs]
        for row, t in zip(rows, terms):
            row["terms"] = dataclasses.asdict(t)
        cluster = with_fitted_factors(cluster, int(world), rows, terms, [r["measured_s"] for r in rows],
                                      date=fits[world].get("date"))
    return cluster


def recorded_fits(cluster: Cluster) -> dict[str, dict]:
    """The engine fits a cluster's notes record, by world (a string, as JSON keys are)."""
    fits = dict(cluster.notes.get("engine_fits", {}))
    latest = cluster.notes.get("engine_fit")
    if latest and "world" in latest:
        fits[str(latest["world"])] = latest  # the latest fit is its world's
    return fits


def with_fitted_factors(cluster: Cluster, world: int, rows: list[dict], terms: list, measured: list[float], *,
                        date: str | None = None) -> Cluster:
    """``cluster`` with factors fitted to these runs on ``world`` ranks: the default and that world's entry of
    the per-world table (a fit at another world is kept: compiler/planner/cluster.py ``factors_for``)."""
    fit = fit_factors(terms, measured)
    for row, err in zip(rows, fit.relative_errors):
        row["fit_error"] = err
    note = {"world": world, "date": date or time.strftime('%Y-%m-%d'), "runs": rows,
            "median_abs_fit_error": statistics.median(abs(e) for e in fit.relative_errors),
            "meaning": "step = compute_scale * compute + comm_scale * communication + dp_comm_scale * fsdp + "
                       "action_overhead * actions + optimizer + step_overhead, fitted (non-negative least squares of "
                       "relative errors) to these runs"}
    fits = {**recorded_fits(cluster), str(world): note}
    # The clause of an earlier fit is replaced; what other measurements wrote after it stays.
    source = re.sub(r"; engine factors fitted to [^;]*", "", cluster.source) + "; engine factors fitted to " + ", ".join(
        f"{len(f['runs'])} engine runs on {w} ranks" + (f" ({f['date']})" if f.get("date") else "")
        for w, f in sorted(fits.items(), key=lambda item: int(item[0])))
    notes = {**cluster.notes, "engine_fit": note, **({"engine_fits": fits} if len(fits) > 1 else {})}
    # A file fitted at one world before the per-world table existed keeps that fit as the table's entry.
    earlier = cluster.notes.get("engine_fit", {}).get("world")
    table = cluster.factors_by_world or ({earlier: cluster.factors} if str(earlier) in fits else {})
    factors = EngineFactors(**fit.factors)
    return dataclasses.replace(cluster, factors=factors, factors_by_world={**table, world: factors}, notes=notes,
                               source=source)
