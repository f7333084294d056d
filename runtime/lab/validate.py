"""``python run.py validate``: predicted against measured step time, on any device.

On this machine: for the tiny and the small model, the planner's best plan on every feasible mesh of the
world size (and, where mp > 1, its best plan with sequence parallelism too), for a mixture of experts its best
plan of every mesh and ep > 1, and for long sequences (T 2048) its best of every mesh with cp > 1, is trained
for a few steps (real torchrun jobs) and its median step time compared with the prediction: median absolute
percentage error, Spearman rank correlation, and whether the plan predicted fastest is within 10% of the
measured fastest. With ``--measured FILE`` (engine summaries from any device, e.g. tests/gpu/gpu_planner_runs.sh on a
lent GPU) nothing is run: the planner prices each recorded run on ``--cluster`` and is compared with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiler.planner.auto import rank_plans
from compiler.planner.cluster import CALIBRATED, LOCAL_PRESET, Cluster, resolve_cluster
from compiler.planner.measured import compare, read_runs
from compiler.planner.precision_probe import check_calibration
from compiler.planner.validation import summarize, summary_line
from compiler.precisions import PRECISIONS
from runtime.commands.flag_groups import command_parser
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import build_parser as training_parser
from runtime.commands.flags import default_config, model_config, model_flags
from runtime.commands.launch import RunSpec, execute
from runtime.config import ConfigError, plan_checker
from runtime.device import has_accelerator
from runtime.lab.speed_probe import probe
from runtime.lab.study import experts, long_context


@dataclass(frozen=True)
class ValidationModel:
    """A model whose plans are run, built from ``flags`` as run.py builds it; ``only`` keeps the plans that use
    that dimension (the dense models cover the others); ``max_cp`` lets the search split sequences."""
    name: str
    global_batch: int
    flags: tuple[str, ...]
    only: str | None = None  # "cp" or "ep"
    max_cp: int = 1

    def model(self):
        return model_config(training_parser().parse_args(list(self.flags)))

    def keeps(self, candidate) -> bool:
        return self.only is None or getattr(candidate, self.only) > 1


MODELS = (
    ValidationModel("tiny", 16, ("--model", "tiny")),
    ValidationModel("small", 8, ("--model", "small", "--seq-len", "128")),
    # The experts study's mixture of experts (8 experts, top 2): its plans with expert parallelism.
    ValidationModel("mixtral-debug", 16, tuple(experts.MOE), only="ep"),
    # The long-context study's Llama at T 2048: its plans with context parallelism.
    ValidationModel("llama3-debug", 4, (*long_context.SHAPE, "--seq-len", "2048"), only="cp", max_cp=4),
)
RUN_FLAGS = ["--data", "synthetic", "--steps", "6", "--log-every", "6", "--eval-every", "0",
             "--eval-batches", "1", "--peak-tflops", "1"]


def validate(*, world: int, cluster: Cluster, precisions: tuple[str, ...], out: str) -> int:
    report: dict = {"world": world, "cluster": cluster.name, "models": {}}
    all_rows = []
    with tempfile.TemporaryDirectory() as work:
        for group in MODELS:
            shape, model = group.model(), group.name
            estimates = rank_plans(shape, world=world, global_batch_size=group.global_batch, cluster=cluster,
                                   validate=plan_checker(default_config(shape)), precisions=precisions,
                                   max_cp=group.max_cp)
            best_per_mesh = {}
            for e in estimates:  # the best of every mesh (cp and ep included), and with sequence parallelism
                c = e.plan
                mesh = (c.dp, c.pp, c.mp, c.cp, c.ep, c.sequence_parallel)
                if e.feasible and group.keeps(c) and mesh not in best_per_mesh:
                    best_per_mesh[mesh] = e
            rows = []
            for (dp, pp, mp, cp, ep, sp), e in best_per_mesh.items():
                name = f"{model}_{dp}x{pp}x{mp}" + (f"_cp{cp}" if cp > 1 else "") + (f"_ep{ep}" if ep > 1 else "")
                spec = RunSpec(name + ("_sp" if sp else ""), world, [*model_flags(shape), *plan_flags(e.plan), *RUN_FLAGS])
                result = execute(spec, Path(work), timeout=900)
                measured = result.summary["step_time_s"] if result.ok else None
                rows.append({"model": model, "plan": e.plan.describe(), "predicted_s": e.step_time,
                             "measured_s": measured, "command": result.command, "error": result.error})
                print(f"{model:>5} {e.plan.describe():<58} predicted {e.step_time:7.3f}s  measured "
                      f"{measured if measured is None else f'{measured:7.3f}s'}", flush=True)
            report["models"][model] = {"rows": rows, **summarize(rows)}
            all_rows += rows
    report["overall"] = summarize(all_rows)
    Path(out).write_text(json.dumps(report, indent=2))
    for name, r in [*report["models"].items(), ("all", report["overall"])]:
        print(summary_line(name, r))
    print(f"wrote {out}")
    return 0


def validate_measured(path: str, *, cluster: Cluster, out: str) -> int:
    """Predicted against measured step time and peak memory of recorded engine runs (no runs launched)."""
    rows = compare(read_runs(path), cluster)
    for r in rows:
        print(f"{r['run']:<14} {r['plan']:<52} predicted {r['predicted_s']:8.4f}s measured {r['measured_s']:8.4f}s "
              f"({100 * r['error']:+.1f}%); peak {r['predicted_peak_gib']:.2f} vs {r['measured_peak_gib']:.2f} GiB")
    summary = summarize([{"plan": r["plan"], "predicted_s": r["predicted_s"], "measured_s": r["measured_s"]}
                         for r in rows])
    memory = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    print(f"{path} on {cluster.name}: MdAPE {100 * summary['mdape']:.1f}%, Spearman {summary['spearman']:.3f}, "
          f"peak memory median |error| {100 * statistics.median(memory):.1f}%" if memory else "")
    Path(out).write_text(json.dumps({"cluster": cluster.name, "measured": path, "rows": rows, **summary}, indent=2))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("run.py validate", "The planner against measured step times: the best plan of every "
                       "feasible mesh of a few models trained here for a few steps (real torchrun jobs), or recorded "
                       "engine runs of any device (--measured), each priced and compared.")
    p.add_argument("--world", type=int, default=4, help="ranks of the runs launched here")
    p.add_argument("--cluster", help=f"cluster JSON or preset; default: the file `run.py calibrate` wrote ({CALIBRATED}) "
                                     f"if any, else {LOCAL_PRESET}")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated precisions the plans may use")
    p.add_argument("--measured", metavar="FILE", help="compare with recorded engine runs of any device (summary.json, a "
                   "results file, e.g. compiler/clusters/measured/h100-engine-runs.json, or a study's folder) "
                   "instead of running plans here")
    p.add_argument("--speed-probe", action="store_true",
                   help="first re-run two of calibration's recorded engine runs (~30 s) and rescale the calibration "
                        "by their speed now (runtime/lab/speed_probe.py)")
    p.add_argument("--out", default="validation.json", help="where to write every row and the summary")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        cluster = resolve_cluster(args.cluster)
        if args.measured:
            return validate_measured(args.measured, cluster=cluster, out=args.out)
        precisions = tuple(x for x in args.precisions.split(",") if x)
        if args.world < 1 or not precisions or any(x not in PRECISIONS for x in precisions):
            raise ConfigError(f"--world must be positive and --precisions a subset of {','.join(PRECISIONS)}")
        if not has_accelerator():
            cluster, note = check_calibration(cluster, precisions)
            if note:
                print(note, flush=True)
        if args.speed_probe:
            cluster = probed(cluster)
        return validate(world=args.world, cluster=cluster, precisions=precisions, out=args.out)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def probed(cluster: Cluster) -> Cluster:
    """``cluster`` rescaled by this machine's speed now against its calibration (runtime/lab/speed_probe.py)."""
    print("probing this machine's speed against its calibration ...", flush=True)
    measured = probe(cluster)
    if measured is None:
        print("speed probe: skipped (the cluster records no calibration points, or the probe failed)")
        return cluster
    ratio, line = measured
    print(line)
    return cluster.rescaled(ratio, line)
