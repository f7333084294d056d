"""Gather every rank's step profiles to the logging rank and write the time split, Chrome trace and Gantt
chart there."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from compiler.schedules import bubble_fraction
from runtime.distributed.collectives import gather_objects
from runtime.distributed.mesh import GridLayout
from runtime.observe.metrics import MetricsLogger
from runtime.observe.png import write_png
from runtime.observe.profiling import CATEGORIES, StepProfile
from runtime.observe.timeline import chrome_trace, render_gantt, time_split


def profile_report(profiles: list[StepProfile], *, layout: GridLayout, schedule: str, microbatches: int,
                   stages_per_rank: int, logger: MetricsLogger, dst: int,
                   group: dist.ProcessGroup | None = None) -> dict | None:
    """Collective: every rank calls it. Rank ``dst`` (the logging rank) gathers every rank's profiles, writes
    time_split.json, timeline.json and images and returns the report; the others return None. Gathering to
    one rank keeps a world of N ranks at N profiles in one process, not N x N over the job."""
    per_rank = gather_objects(profiles, dst=dst, group=group)
    if per_rank is None:
        return None
    splits = []
    for rank, steps in enumerate(per_rank):
        step_splits = [time_split(p) for p in steps]
        mean = {k: sum(s[k] for s in step_splits) / len(step_splits) for k in step_splits[0]}
        d, p, m = layout.coordinates(rank)
        splits.append({"rank": rank, "dp": d, "pp": p, "mp": m, **mean})
    measured_idle = sum(s["idle_fraction"] for s in splits) / len(splits)
    report = {
        "profiled_steps": len(per_rank[0]),
        "categories": list(CATEGORIES),
        "per_rank": splits,
        "mean_fraction": {k: sum(s[f"{k}_fraction"] for s in splits) / len(splits) for k in CATEGORIES},
        "measured_bubble_fraction": measured_idle,
        "theoretical_bubble_fraction": bubble_fraction(schedule, p=layout.pp, m=microbatches, v=stages_per_rank),
        "schedule": schedule,
    }
    if logger.enabled:
        last_step = [steps[-1] for steps in per_rank]
        labels = {r: f"rank {r} (dp {d}, pp {p}, mp {m})" for r in range(len(per_rank))
                  for d, p, m in [layout.coordinates(r)]}
        with open(os.path.join(logger.logdir, "timeline.json"), "w") as f:
            json.dump(chrome_trace(last_step, rank_labels=labels), f)
        logger.write_json("time_split.json", report)
        gantt = render_gantt(last_step)
        logger.image(f"timeline/{schedule}", gantt)
        write_png(gantt, os.path.join(logger.logdir, "timeline.png"))
        logger.text("time_split", _markdown_table(splits, report))
    return report


def _markdown_table(splits: list[dict], report: dict) -> str:
    header = "| rank | step (s) | " + " | ".join(CATEGORIES) + " |"
    rule = "|" + " --- |" * (len(CATEGORIES) + 2)
    rows = [f"| {s['rank']} | {s['step_time']:.3f} | " + " | ".join(f"{100 * s[f'{k}_fraction']:.1f}%" for k in CATEGORIES) + " |"
            for s in splits]
    footer = (f"\n\nmeasured bubble (idle) fraction {report['measured_bubble_fraction']:.3f}, theoretical "
              f"{report['theoretical_bubble_fraction']:.3f} ({report['schedule']})")
    return "\n".join([header, rule, *rows]) + footer
