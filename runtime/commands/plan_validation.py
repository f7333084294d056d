"""``python run.py plan --validate``: predicted against measured step time, on any device.

On this machine: for the tiny and the small model, the planner's best plan on every feasible mesh of the
world size (and, where mp > 1, its best plan with sequence parallelism too), for a mixture of experts its best
plan of every mesh and ep > 1, and for long sequences (T 2048) its best of every mesh with cp > 1, is trained
for a few steps (real torchrun jobs) and its median step time compared with the prediction: median absolute
percentage error, Spearman rank correlation, and whether the plan predicted fastest is within 10% of the
measured fastest. With ``--measured FILE`` (engine summaries from any device, e.g. tests/gpu_planner_runs.sh on a
lent GPU) nothing is run: the planner prices each recorded run on ``--cluster`` and is compared with it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiler.planner.cluster import Cluster
from runtime.commands.flags import build_parser, default_config, model_config, model_flags
from runtime.commands.launch import RunSpec, execute
from runtime.commands.measured_runs import compare, read_runs
from runtime.commands.study import experts, long_context
from runtime.planning import rank_plans


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
        return model_config(build_parser().parse_args(list(self.flags)))

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


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else 0.0


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["measured_s"]]
    ape = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in ok]
    best_predicted = min(ok, key=lambda r: r["predicted_s"], default=None)
    best_measured = min(ok, key=lambda r: r["measured_s"], default=None)
    return {
        "runs": len(rows), "measured": len(ok),
        "mdape": statistics.median(ape) if ape else None,
        "spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]) if len(ok) > 1 else None,
        "predicted_best": best_predicted and best_predicted["plan"],
        "measured_best": best_measured and best_measured["plan"],
        "predicted_best_within_10pct": bool(ok) and best_predicted["measured_s"] <= 1.10 * best_measured["measured_s"],
    }


def validate(*, world: int, cluster: Cluster, precisions: tuple[str, ...], out: str) -> int:
    report: dict = {"world": world, "cluster": cluster.name, "models": {}}
    all_rows = []
    with tempfile.TemporaryDirectory() as work:
        for group in MODELS:
            shape, model = group.model(), group.name
            estimates = rank_plans(default_config(shape), world=world, global_batch_size=group.global_batch,
                                   cluster=cluster, precisions=precisions, max_cp=group.max_cp)
            best_per_mesh = {}
            for e in estimates:  # the best of every mesh (cp and ep included), and with sequence parallelism
                c = e.candidate
                mesh = (c.dp, c.pp, c.mp, c.cp, c.ep, c.sequence_parallel)
                if e.feasible and group.keeps(c) and mesh not in best_per_mesh:
                    best_per_mesh[mesh] = e
            rows = []
            for (dp, pp, mp, cp, ep, sp), e in best_per_mesh.items():
                name = f"{model}_{dp}x{pp}x{mp}" + (f"_cp{cp}" if cp > 1 else "") + (f"_ep{ep}" if ep > 1 else "")
                spec = RunSpec(name + ("_sp" if sp else ""), world, [*model_flags(shape), *e.candidate.flags(), *RUN_FLAGS])
                result = execute(spec, Path(work), timeout=900)
                measured = result.summary["step_time_s"] if result.ok else None
                rows.append({"model": model, "plan": e.candidate.describe(), "predicted_s": e.step_time,
                             "measured_s": measured, "command": result.command, "error": result.error})
                print(f"{model:>5} {e.candidate.describe():<58} predicted {e.step_time:7.3f}s  measured "
                      f"{measured if measured is None else f'{measured:7.3f}s'}", flush=True)
            report["models"][model] = {"rows": rows, **summarize(rows)}
            all_rows += rows
    report["overall"] = summarize(all_rows)
    Path(out).write_text(json.dumps(report, indent=2))
    for name, r in [*report["models"].items(), ("all", report["overall"])]:
        print(summary_line(name, r))
    print(f"wrote {out}")
    return 0


def summary_line(name: str, r: dict) -> str:
    """One model's (or all models') figures; a rank correlation needs two measured runs, an error one (a small
    world can leave a model one plan, e.g. one ep plan on 2 ranks)."""
    mdape = "n/a" if r["mdape"] is None else f"{100 * r['mdape']:.1f}%"
    rho = "n/a" if r["spearman"] is None else f"{r['spearman']:.3f}"
    return (f"{name}: MdAPE {mdape}, Spearman {rho}, predicted best within 10% of measured best: "
            f"{r['predicted_best_within_10pct']} ({r['measured']} of {r['runs']} runs measured)")


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
