"""The study's pictures: SVG charts drawn from the results dict into DIR/charts/, beside REPORT.md.

Each chart is a function of the results alone, as the report's tables are, and gives None when its
section did not run or measured nothing: a study of some sections draws only their charts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from runtime.lab.study import sharding
from runtime.observe.profiling import CATEGORIES
from runtime.observe.svg import bar_chart, line_chart, stacked_bar_chart

# Scaling kinds drawn as one line each; the mixed meshes share one (a point per mesh).
SCALING_LINES = {"DP": "DP", "PP": "PP", "MP": "MP", "mix": "mix / 3D", "3D": "mix / 3D"}


def throughput(results: dict, title: str) -> str | None:
    rows = [r for r in results.get("throughput", {}).get("table", []) if r.get("speedup_vs_naive")]
    if not rows:
        return None
    return bar_chart(
        title, [f"{r['group']}: {r['label']}" for r in rows],
        {"measured speed-up vs naive": [r["speedup_vs_naive"] for r in rows]},
        markers={"bubble-formula bound": [r.get("theoretical_speedup") for r in rows],
                 "bound at the measured compute speed": [r.get("bound_at_measured_compute") for r in rows]},
        reference=("naive (1x)", 1.0), value_label="speed-up over the naive schedule (x)")


def _scaling_lines(results: dict, key: str) -> dict[str, list[tuple[float, float]]]:
    """A line per parallelism kind, each starting from the 1-rank run (where every kind is the same run)."""
    rows = [r for r in results.get("scaling", {}).get("table", []) if r.get(key) is not None]
    single = [(1, r[key]) for r in rows if r["kind"] == "single"][:1]
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["kind"] in SCALING_LINES:
            lines.setdefault(SCALING_LINES[r["kind"]], list(single)).append((r["world"], r[key]))
    return lines


def _worlds_and_cores(results: dict) -> tuple[list[int], int]:
    worlds = sorted({1, *(r["world"] for r in results.get("scaling", {}).get("table", []))})
    return worlds, results.get("machine", {}).get("cores") or os.cpu_count() or 1


def scaling(results: dict, title: str) -> str | None:
    lines = _scaling_lines(results, "speedup")
    if not lines:
        return None
    worlds, cores = _worlds_and_cores(results)
    ideal = {"ideal (speed-up = ranks)": [(w, w) for w in worlds]}
    if worlds[-1] > cores:  # ranks beyond the cores time-share them: the machine allows at most `cores`
        ideal[f"ideal on {cores} cores"] = [(w, min(w, cores)) for w in worlds]
    return line_chart(title, {**lines, **ideal}, x_label="ranks", y_label="speed-up over 1 rank (x)", dashed=list(ideal))


def scaling_efficiency(results: dict, title: str) -> str | None:
    lines = {kind: [(w, 100 * e) for w, e in points] for kind, points in _scaling_lines(results, "efficiency").items()}
    if not lines:
        return None
    worlds, cores = _worlds_and_cores(results)
    ideal = {f"ideal on {cores} cores": [(w, 100 * min(w, cores) / w) for w in worlds]} if worlds[-1] > cores else {}
    return line_chart(title, {**lines, **ideal}, x_label="ranks", y_label="efficiency: speed-up / ranks (%)",
                      dashed=list(ideal), reference=("ideal (100%)", 100.0))


def time_split(results: dict, title: str) -> str | None:
    rows = results.get("time_split", {}).get("rows", [])
    if not rows:
        return None
    return stacked_bar_chart(title, [f"{r['group']}: {r['label']}, rank {r['rank']}" for r in rows],
                             {k: [100 * (r.get(k) or 0.0) for r in rows] for k in CATEGORIES},
                             value_label="share of the step (%)")


def memory(results: dict, title: str) -> str | None:
    mem = results.get("memory")
    lines = {precision: [(t["micro_batch_size"], t["peak_gb"]) for t in r["trials"] if t.get("peak_gb") is not None]
             for precision, r in (mem or {}).get("search", {}).items()}
    lines = {precision: points for precision, points in lines.items() if points}
    if not lines:
        return None
    return line_chart(title, lines, x_label="micro-batch size (the search's trials)", y_label="peak tensor memory per rank (GB)",
                      reference=(f"budget {mem['budget_gb']:.3g} GB", mem["budget_gb"]))


def memory_batch(results: dict, title: str) -> str | None:
    search = (results.get("memory") or {}).get("search", {})
    if not search:
        return None
    precisions = list(search)
    return bar_chart(title, precisions,
                     {"largest micro-batch within the budget": [search[p]["max_micro_batch"] for p in precisions]},
                     markers={"first failing micro-batch": [search[p]["first_failing"] for p in precisions]},
                     value_label="micro-batch size")


# name -> (title, drawing); the name is the file's stem and what the report asks for.
CHARTS: dict[str, tuple[str, Callable[[dict, str], str | None]]] = {
    "throughput": ("Speed-up over naive per schedule, against the bubble bound", throughput),
    "memory": ("Peak tensor memory of each trial of the batch search", memory),
    "memory_batch": ("Largest micro-batch within the budget, per precision", memory_batch),
    "time_split": ("Where each rank's step goes", time_split),
    "scaling": ("Speed-up against ranks (same global batch)", scaling),
    "scaling_efficiency": ("Scaling efficiency against ranks", scaling_efficiency),
    "sharding": ("Peak tensor memory per rank of each configuration, measured and predicted", sharding.memory_chart),
}


def write_charts(results: dict, out: Path) -> dict[str, str | None]:
    """Draw every chart that has data into out/charts/. Returns name -> path relative to ``out`` (None: not drawn)."""
    paths: dict[str, str | None] = {}
    for name, (title, draw) in CHARTS.items():
        svg = draw(results, title)
        if svg is not None:
            (out / "charts").mkdir(parents=True, exist_ok=True)
            (out / "charts" / f"{name}.svg").write_text(svg)
        paths[name] = f"charts/{name}.svg" if svg is not None else None
    return paths


def markdown(results: dict, *names: str) -> list[str]:
    """Image lines for the drawn charts among ``names`` (from results["charts"]), for the report to put by a table."""
    paths = results.get("charts") or {}
    return [line for name in names if paths.get(name) for line in (f"![{CHARTS[name][0]}]({paths[name]})", "")]
