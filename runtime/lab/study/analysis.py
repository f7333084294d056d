"""Turn raw study runs into the tables of the report. Pure functions over results.json data."""

from __future__ import annotations

import functools
import os
import statistics
from typing import Callable

from compiler.partition import rank_costs, stage_costs_with_ends
from compiler.schedules import SCHEDULES, bubble_fraction, ideal_speedup_over_naive
from runtime.distributed.cpu_binding import assign_cores
from runtime.observe.metrics import steady_step_times
from runtime.observe.profiling import CATEGORIES

COMM = ("pp_send_recv", "tp_comm", "dp_comm")
COMPUTE = ("forward", "backward")


def steady_times(summary: dict) -> list[float]:
    """Step times after warm-up, by the same rule as the engine's summary."""
    return steady_step_times(summary.get("step_times") or [summary["step_time_s"]])


def pooled_samples_per_sec(runs: list[dict]) -> float | None:
    """Median over the steady steps of every repetition of one configuration."""
    times = [t for r in runs if r["ok"] for t in steady_times(r["summary"])]
    if not times:
        return None
    batch = runs[0]["summary"]["samples_per_sec"] * runs[0]["summary"]["step_time_s"]
    return batch / statistics.median(times)


def _mean_profile(run: dict) -> dict | None:
    profile = (run.get("summary") or {}).get("profile")
    return profile["mean_fraction"] if profile else None


def compute_seconds(run: dict) -> float | None:
    """Forward + backward seconds per step, averaged over ranks, from a profiled run's time split."""
    profile = (run.get("summary") or {}).get("profile") if run["ok"] else None
    if not profile:
        return None
    ranks = profile["per_rank"]
    return statistics.mean((r["forward_fraction"] + r["backward_fraction"]) * r["step_time"] for r in ranks)


def _mean_compute_seconds(runs: list[dict]) -> float | None:
    values = [c for c in map(compute_seconds, runs) if c is not None]
    return statistics.mean(values) if values else None


def throughput_table(runs: list[dict]) -> list[dict]:
    """Per mesh and schedule: pooled throughput, speed-up over naive, the bubble-formula bound, and that
    bound corrected by the measured compute speed.

    The bubble formulas assume a stage computes as fast while its neighbours compute as when it runs
    alone (as under naive). Where ranks share memory bandwidth and caches (CPU cores; GPUs in one node
    less so) that does not hold: the time split measures each rank's forward + backward seconds, and
    ``compute_slowdown`` = those seconds under this schedule / under naive. The bound the hardware
    allows is then the formula's bound / compute_slowdown.
    """
    rows = []
    groups = list(dict.fromkeys(r["group"] for r in runs))
    for group in groups:
        in_group = [r for r in runs if r["group"] == group]
        labels = list(dict.fromkeys(r["label"] for r in in_group))
        naive_runs = [r for r in in_group if r["label"] == "naive" and not r.get("skipped")]
        naive = pooled_samples_per_sec(naive_runs)
        naive_compute = _mean_compute_seconds(naive_runs)
        for label in labels:
            reps = [r for r in in_group if r["label"] == label]
            first = reps[0]
            row = {"group": group, "label": label, "schedule": first["schedule"], "p": first["pp"],
                   "m": first["m"], "v": first["v"], "dp": first["dp"], "mp": first["mp"],
                   "micro_batch_size": first.get("micro_batch_size")}
            if first.get("skipped"):
                rows.append({**row, "skipped": first["skipped"]})
                continue
            sps = pooled_samples_per_sec(reps)
            if sps is None:
                rows.append({**row, "failed": next((r["error"] for r in reps if r["error"]), "failed")})
                continue
            tokens = sps * reps[0]["summary"]["tokens_per_sec"] / reps[0]["summary"]["samples_per_sec"]
            fractions = [_mean_profile(r) for r in reps if r["ok"] and _mean_profile(r)]
            idle = statistics.mean(f["idle"] for f in fractions) if fractions else None
            bound = ideal_speedup_over_naive(first["schedule"], p=first["pp"], m=first["m"], v=first["v"])
            compute = _mean_compute_seconds(reps)
            slowdown = compute / naive_compute if compute and naive_compute else None
            rows.append({
                **row, "samples_per_sec": sps, "tokens_per_sec": tokens, "repetitions": len(reps),
                "speedup_vs_naive": sps / naive if naive else None,
                "speedup_by_round": ratio_by_round(in_group, lambda r: r["label"] == label and not r.get("skipped"),
                                                   lambda r: r["label"] == "naive" and not r.get("skipped")),
                "theoretical_speedup": bound,
                "compute_slowdown": slowdown,
                "bound_at_measured_compute": bound / slowdown if slowdown else None,
                "measured_idle_fraction": idle,
                "theoretical_bubble_fraction": bubble_fraction(first["schedule"], p=first["pp"], m=first["m"], v=first["v"]),
                "mfu": statistics.median(r["summary"]["mfu"] for r in reps if r["ok"]),
            })
    return rows


def time_split_rows(runs: list[dict]) -> list[dict]:
    """Per rank and category, from the last repetition of every profiled run."""
    latest = {}
    for r in runs:
        if r["ok"] and (r["summary"] or {}).get("profile"):
            latest[(r.get("group") or r.get("kind"), r.get("label") or f"{r['dp']}x{r['pp']}x{r['mp']}")] = r
    rows = []
    for (group, label), r in latest.items():
        profile = r["summary"]["profile"]
        for rank in profile["per_rank"]:
            covered = 1.0 - rank["other_fraction"]
            rows.append({"group": group, "label": label, "rank": rank["rank"], "step_time": rank["step_time"],
                         **{k: rank[f"{k}_fraction"] for k in CATEGORIES}, "tracked_fraction": covered,
                         "theoretical_bubble": profile["theoretical_bubble_fraction"]})
    return rows


def scaling_table(runs: list[dict], *, cores: int | None = None) -> list[dict]:
    cores = cores or os.cpu_count() or 1
    base = next((r for r in runs if r["kind"] == "single" and r["ok"]), None)
    base_sps = pooled_samples_per_sec([base]) if base else None
    rows = []
    for r in runs:
        row = {"kind": r["kind"], "world": r["world"], "mesh": f"{r['dp']}x{r['pp']}x{r['mp']}"}
        if not r["ok"]:
            rows.append({**row, "failed": r["error"]})
            continue
        sps = pooled_samples_per_sec([r])
        fractions = _mean_profile(r) or {}
        compute = sum(fractions.get(k, 0.0) for k in COMPUTE)
        comm = sum(fractions.get(k, 0.0) for k in COMM)
        speedup = sps / base_sps if base_sps else None
        rows.append({
            **row, "samples_per_sec": sps, "speedup": speedup,
            "efficiency": speedup / r["world"] if speedup else None,
            "efficiency_vs_cores": speedup / min(r["world"], cores) if speedup else None,
            "compute_fraction": compute, "comm_fraction": comm, "idle_fraction": fractions.get("idle", 0.0),
            "compute_to_comm": compute / comm if comm > 0 else None,
        })
    return rows


def overhead_summary(runs: list[dict]) -> dict:
    """Engine at 1x1x1 against the plain loop, both pooled over their alternated repetitions."""
    engine = pooled_samples_per_sec([r for r in runs if r["who"] == "engine"])
    plain = pooled_samples_per_sec([r for r in runs if r["who"] == "plain"])
    return {"engine_samples_per_sec": engine, "plain_samples_per_sec": plain,
            "engine_over_plain": engine / plain if engine and plain else None,
            "repetitions": sum(r["who"] == "engine" for r in runs)}


NAMES = {"pp_send_recv": "pipeline send/receive", "idle": "idle (waiting for a pipeline neighbour)",
         "tp_comm": "tensor-parallel collectives", "dp_comm": "data-parallel collectives",
         "optimizer": "the optimizer step", "other": "untracked bookkeeping"}


def bottleneck_sentences(rows: list[dict]) -> list[str]:
    """For every profiled configuration: its two largest costs besides forward/backward compute."""
    sentences = []
    for key in dict.fromkeys((r["group"], r["label"]) for r in rows):
        ranks = [r for r in rows if (r["group"], r["label"]) == key]
        mean = {k: statistics.mean(r[k] for r in ranks) for k in NAMES}
        compute = statistics.mean(r["forward"] + r["backward"] for r in ranks)
        top = sorted(mean, key=mean.get, reverse=True)[:2]
        sentences.append(f"{key[0]} {key[1]}: compute {100 * compute:.0f}% of the step; the largest other costs are "
                         + " and ".join(f"{NAMES[k]} ({100 * mean[k]:.1f}%)" for k in top) + ".")
    return sentences


def pipeline_time_units(stage_costs: list[float], *, pp: int, cores: int, microbatches: int,
                        placement: str = "loop") -> float:
    """Relative step time of a compute-bound pipeline, each pp rank running its stages (``placement``).

    With uneven stages c_s and m micro-batches the step takes sum(c_s) + (m - 1) * max(c_s): one
    micro-batch's trip through every stage (fill and drain) plus m - 1 more at the busiest stage's
    pace (the makespan of a flow shop of identical jobs). With fewer cores than ranks the ranks are
    packed on the cores as ``--bind-cores cost`` does (longest first onto the least-loaded core) and a
    core runs its ranks' work one after another, so the pace is the busiest core's load. More
    micro-batches weigh the pace more, so the better split gains more.
    """
    per_rank = rank_costs(stage_costs, placement, pp=pp)
    loads = per_rank
    if cores < pp:
        placed = assign_cores(per_rank, list(range(cores)))
        loads = [sum(c for c, core in zip(per_rank, placed) if core == k) for k in range(cores)]
    return sum(stage_costs) + (microbatches - 1) * max(loads)


def ratio_by_round(runs: list[dict], numerator: Callable[[dict], bool], denominator: Callable[[dict], bool]) -> list[float]:
    """Per repetition ("round") of a side-by-side pair: pooled throughput of one side over the other.
    Their spread shows how much of a ratio is the machine's noise."""
    ratios = []
    for rnd in sorted({r.get("round", 0) for r in runs}):
        num = pooled_samples_per_sec([r for r in runs if r.get("round", 0) == rnd and numerator(r)])
        den = pooled_samples_per_sec([r for r in runs if r.get("round", 0) == rnd and denominator(r)])
        if num and den:
            ratios.append(num / den)
    return ratios


def split_table(runs: list[dict], *, cores: int | None = None, layer_seconds: list[float] | None = None) -> list[dict]:
    """Per pp: auto and uniform throughput (pooled over repetitions), their ratio overall and per
    repetition, the chosen splits, and the ratio the two splits' stage costs predict with a core per rank
    and with this machine's cores: from the estimated costs the runs split by and, given
    ``layer_seconds`` (measured forward + backward of [embedding, blocks..., head]), from measured times."""
    cores = cores or os.cpu_count() or 1
    rows = []
    for schedule, pp in dict.fromkeys((r.get("schedule", "1f1b"), r["pp"]) for r in runs):
        placement = SCHEDULES[schedule].placement
        row = {"pp": pp, "schedule": schedule, "cores": cores}
        costs = {}
        same = [r for r in runs if r["pp"] == pp and r.get("schedule", "1f1b") == schedule]
        for split in ("auto", "uniform"):
            reps = [r for r in same if r["split"] == split]
            row[f"{split}_samples_per_sec"] = pooled_samples_per_sec(reps)
            ok = [r for r in reps if r["ok"]]
            row[f"{split}_blocks_per_stage"] = ok[0]["summary"]["blocks_per_stage"] if ok else None
            costs[split] = ok[0]["summary"].get("stage_costs") if ok else None
        a, u = row["auto_samples_per_sec"], row["uniform_samples_per_sec"]
        row["auto_over_uniform"] = a / u if a and u else None
        row["auto_over_uniform_by_round"] = ratio_by_round(same, lambda r: r["split"] == "auto",
                                                           lambda r: r["split"] == "uniform")
        m = row["microbatches"] = same[0].get("m", 1)
        gain = functools.partial(_split_gain, pp=pp, microbatches=m, placement=placement)
        if costs["auto"] and costs["uniform"]:
            row["expected_core_per_rank"] = gain(costs, cores=pp)
            row["expected_on_cores"] = gain(costs, cores=cores)
        if layer_seconds and row["auto_blocks_per_stage"] and row["uniform_blocks_per_stage"]:
            timed = {split: stage_costs_with_ends(layer_seconds, row[f"{split}_blocks_per_stage"])
                     for split in ("auto", "uniform")}
            row["measured_expected_core_per_rank"] = gain(timed, cores=pp)
            row["measured_expected_on_cores"] = gain(timed, cores=cores)
        rows.append(row)
    return rows


def _split_gain(stage_costs: dict[str, list[float]], *, pp: int, cores: int, microbatches: int,
                placement: str) -> float:
    """Predicted auto / uniform throughput: uniform's step time over auto's."""
    uniform, auto = (pipeline_time_units(stage_costs[s], pp=pp, cores=cores, microbatches=microbatches,
                                         placement=placement) for s in ("uniform", "auto"))
    return uniform / auto
