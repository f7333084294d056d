"""How fast this machine runs the engine now, against the calibration the planner prices plans with.

A shared machine's speed drifts (other tenants, frequency scaling), and so does the engine between
calibrations: plans priced with a calibration taken on another day all come out off by about the same
factor. ``probe`` re-runs two of the engine runs calibration recorded (runtime/lab/calibrate_engine.py,
the cluster's ``notes.engine_fit.runs``): the same models, plans and flags on the same number of ranks.
It returns the geometric mean of measured-now / measured-then; compiler/planner/cluster.py's
``Cluster.rescaled`` applies it to every time-like rate of the cluster. Takes about half a minute.

Why whole runs and not kernels: a probe that re-timed calibration's isolated block benchmark made the
planner worse (blocks and whole runs drifted in opposite directions on the same day). What drifts is what
the engine factors were fitted to, so the probe measures that. Opt-in (``run.py validate --speed-probe``):
it costs half a minute and helps when the machine's load differs from calibration day's.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

from compiler.planner.cluster import Cluster
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import model_flags
from runtime.commands.launch import RunSpec, execute
from runtime.lab.calibrate_engine import RUN_FLAGS, calibration_runs

# Indices into calibration_runs(): a light pipeline run (fixed costs dominate: actions, point-to-point,
# step overhead) and a heavy PP x TP run (compute and collectives dominate).
PROBE_RUNS = (1, 6)


def probe(cluster: Cluster, *, timeout: float = 300) -> tuple[float, str] | None:
    """(now / calibrated step-time ratio, one-line description), or None when the cluster records no
    engine runs of the current calibration set or a probe run failed."""
    fit = cluster.notes.get("engine_fit")
    if not fit:
        return None
    try:
        runs = calibration_runs(fit["world"])
    except ValueError:
        return None
    recorded = fit["runs"]
    if [r["plan"] for r in recorded] != [plan.describe() for _, plan in runs]:
        return None  # calibrated with another run set: nothing comparable to re-run
    ratios, parts = [], []
    with tempfile.TemporaryDirectory() as work:
        for i in PROBE_RUNS:
            model, plan = runs[i]
            spec = RunSpec(f"probe_{i}", fit["world"], [*model_flags(model), *plan_flags(plan), *RUN_FLAGS])
            result = execute(spec, Path(work), timeout=timeout)
            if not result.ok:
                return None
            then = recorded[i]["measured_s"]
            now = result.summary["step_time_s"]
            ratios.append(now / then)
            parts.append(f"{plan.describe()}: {now:.3f} s/step vs {then:.3f} calibrated")
    ratio = math.exp(statistics.mean(math.log(r) for r in ratios))
    return ratio, f"speed probe: the engine now takes {ratio:.2f}x its calibrated time ({'; '.join(parts)})"
