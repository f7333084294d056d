"""Measured engine runs on any device, for the planner: read them, price them, compare, fit.

A run is an engine ``summary.json`` (its ``config``: model and plan; ``step_time_s``; ``peak_bytes``), a folder of
run folders (a study's), or a results file of several keyed by name (``tests/gpu/gpu_check.sh`` writes one:
``OUT=dir bash tests/gpu/gpu_check.sh`` then ``dir/results.json``). ``run.py calibrate --measured FILE`` fits a
cluster's engine factors to them (on a lent GPU: one or two runs fit ``compute_scale`` alone, three or more
``step_overhead`` too);
``run.py validate --measured FILE`` compares the planner's predictions with them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from compiler.parallel_plan import ParallelPlan, plan_of_run
from compiler.planner.cluster import Cluster
from compiler.planner.fit import fit_factors
from compiler.planner.search import Estimate, price
from compiler.planner.shape import DecoderShape
from models import config_from_dict


@dataclass(frozen=True)
class MeasuredRun:
    name: str
    shape: DecoderShape
    plan: ParallelPlan
    step_time_s: float
    peak_bytes: float | None
    device: str


def read_runs(path: str | Path) -> list[MeasuredRun]:
    """Every engine summary in ``path`` (one summary, a results file of them, or a folder of run folders such as
    a study's, each with its summary.json) that records its config."""
    files = sorted(Path(path).glob("*/summary.json")) if Path(path).is_dir() else [Path(path)]
    loaded = {}
    for f in files:
        try:
            loaded[f] = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not JSON ({e})") from None
    if Path(path).is_dir():
        summaries = {f.parent.name: data for f, data in loaded.items() if isinstance(data, dict)}
    else:
        data = loaded[Path(path)]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a JSON object is a summary or a results file; got a {type(data).__name__}")
        summaries = {"run": data} if "step_time_s" in data else {k: v for k, v in data.items() if isinstance(v, dict)}
    runs = []
    for name, s in sorted(summaries.items()):
        if "config" not in s or not s.get("step_time_s"):
            continue  # a plain-loop result, or a summary written without its config
        try:
            model = config_from_dict(s["config"]["model"])
            runs.append(MeasuredRun(name, DecoderShape.from_config(model), plan_of_run(s["config"]),
                                    float(s["step_time_s"]), _peak_tensor_bytes(s), str(s.get("device", ""))))
        except (KeyError, TypeError, ValueError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}: run {name!r}: its config is not an engine summary's ({what})") from None
    if not runs:
        raise ValueError(f"{path}: no engine summary with a config and a step time (summary.json, or results.json "
                         f"of tests/gpu/gpu_check.sh)")
    return runs


def _peak_tensor_bytes(summary: dict) -> float | None:
    """The peak the memory model predicts: tensor bytes. On a GPU ``peak_bytes`` is ``max_memory_allocated``;
    on the CPU it is the process's resident peak (interpreter and libraries too), so only a run with
    ``--profile-memory`` (``peak_tensor_bytes``) has one."""
    if summary.get("peak_tensor_bytes"):
        return summary["peak_tensor_bytes"]
    device = str(summary.get("device", "")).lower()
    return summary.get("peak_bytes") if "cuda" in device or "nvidia" in device else None


def predictions(runs: list[MeasuredRun], cluster: Cluster) -> list[Estimate]:
    return [price(r.shape, r.plan, cluster=cluster) for r in runs]


def fit_to_runs(cluster: Cluster, runs: list[MeasuredRun]) -> Cluster:
    """``cluster`` with engine factors fitted to ``runs`` (as many factors as the runs determine)."""
    factors = ("compute_scale",) if len(runs) < 3 else ("compute_scale", "step_overhead")
    estimates = predictions(runs, cluster.with_factors(compute_scale=1.0, step_overhead=0.0))
    fit = fit_factors([e.terms for e in estimates], [r.step_time_s for r in runs], factors=factors,
                      fixed=cluster.factors)
    rows = [{"run": r.name, "plan": r.plan.describe(), "measured_s": r.step_time_s, "fit_error": err, "device": r.device}
            for r, err in zip(runs, fit.relative_errors)]
    notes = {**cluster.notes, "engine_fit": {
        "runs": rows, "factors": list(factors), "median_abs_fit_error": statistics.median(abs(e) for e in fit.relative_errors),
        "meaning": "factors fitted (non-negative least squares of relative errors) to these measured engine runs"}}
    source = cluster.source.split("; engine factors")[0]
    source += f"; engine factors {', '.join(factors)} fitted to {len(runs)} measured runs ({time.strftime('%Y-%m-%d')})"
    return dataclasses.replace(cluster.with_factors(**{k: fit.factors[k] for k in factors}), notes=notes, source=source)


def compare(runs: list[MeasuredRun], cluster: Cluster) -> list[dict]:
    """Per run: measured and predicted step time and peak memory, and their errors."""
    out = []
    for r, e in zip(runs, predictions(runs, cluster)):
        memory = None if not r.peak_bytes else e.memory_per_rank / r.peak_bytes - 1
        out.append({"run": r.name, "plan": r.plan.describe(), "measured_s": r.step_time_s, "predicted_s": e.step_time,
                    "error": e.step_time / r.step_time_s - 1, "measured_peak_gib": (r.peak_bytes or 0) / 2**30,
                    "predicted_peak_gib": e.memory_per_rank / 2**30, "memory_error": memory})
    return out
