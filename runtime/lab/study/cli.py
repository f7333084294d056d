"""``python run.py study``: the performance study in one command.

Launches real torchrun training runs one at a time and writes DIR/results.json, DIR/REPORT.md with its
SVG charts in DIR/charts/, DIR/commands.txt, every run's TensorBoard logs under DIR, and every run's
hyperparameters and figures in TensorBoard's HParams tab (DIR/hparams).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from runtime.atomic import write_json
from runtime.commands.flags import HelpFormatter
from runtime.commands.launch import RunResult, RunSpec, execute
from runtime.device import device_description, has_accelerator, select_device
from runtime.lab.study import (
    analysis,
    charts,
    checkpointing,
    experts,
    hparams,
    long_context,
    plan,
    report,
    sharding,
    zero_bubble,
)
from runtime.lab.study.memory_search import search_max_batch
from runtime.observe.layer_timing import measure_layer_times

SECTIONS = ("throughput", "memory", "scaling", "overhead", "split", "sharding", "replicate", "zero_bubble",
            "checkpointing", "experts", "long_context")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py study", formatter_class=HelpFormatter,
        description="The performance study in one command: real torchrun training runs, one at a time, writing "
                    "results.json, REPORT.md, commands.txt and TensorBoard logs to --out.")
    p.add_argument("--world", type=int, default=8, help="largest number of ranks to use (1, 2, 4 or 8)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="a smaller model, one repetition, the naive, 1f1b and interleaved v=2 schedules, scaling "
                           "up to 4 ranks (under 10 minutes)")
    size.add_argument("--smoke", action="store_true",
                      help="the smallest study that writes every section (a few minutes; the test suite runs it): "
                           "checks the pipeline of the study, its numbers mean nothing")
    p.add_argument("--out", help="output folder (default: tensorboard_logs/study_<timestamp>)")
    p.add_argument("--mem-budget-gb", type=float, help="per-rank budget of peak tensor memory for the batch "
                                                        f"search (default: {plan.FULL.memory_budget_gb}, or "
                                                        f"{plan.QUICK.memory_budget_gb} with --quick, {plan.SMOKE.memory_budget_gb} with --smoke)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset of " + ", ".join(SECTIONS) + " (time split and timelines come "
                        "with throughput)")
    return p


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def report(self, result: RunResult, detail: str) -> None:
        self.done += 1
        status = detail if result.ok else f"FAILED: {result.error}"
        print(f"[{self.done}/~{self.total}] {result.name}: {status} ({result.seconds:.0f}s, "
              f"{(time.monotonic() - self.start) / 60:.1f} min elapsed)", flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or args.world not in (1, 2, 4, 8) or (args.mem_budget_gb is not None and args.mem_budget_gb <= 0):
        print(f"error: --world must be 1, 2, 4 or 8 (got {args.world}); --sections from {', '.join(SECTIONS)} "
              f"(got {args.sections}); --mem-budget-gb must be positive", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = {"smoke": plan.SMOKE, "quick": plan.QUICK, "full": plan.FULL}[mode]
    budget_gb = args.mem_budget_gb or settings.memory_budget_gb
    out = Path(args.out or f"tensorboard_logs/study_{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)

    specs = {
        "throughput": plan.throughput_specs(args.world, settings) if "throughput" in sections and args.world >= 2 else [],
        "scaling": plan.scaling_specs(args.world, settings) if "scaling" in sections else [],
        "overhead": plan.overhead_specs(settings) if "overhead" in sections else [],
        "split": plan.split_specs(args.world, settings) if "split" in sections and args.world >= 2 else [],
        "sharding": sharding.memory_specs(min(args.world, settings.sharding_world), settings.sharding_model,
                                          large=settings.sharding_large, other_shapes=settings.sharding_other_shapes,
                                          smoke=mode == "smoke") if "sharding" in sections else [],
        "replicate": sharding.replicate_specs(settings.replicate_rounds, settings.replicate_model,
                                              micro_batch_size=4, microbatches=4, steps=settings.steps + 1)
        if "replicate" in sections and args.world >= 2 else [],
        "zero_bubble": zero_bubble.zero_bubble_specs(settings.zero_bubble_rounds, settings.zero_bubble_model.flags(),
                                                     steps=settings.steps + 1, compiled=settings.zero_bubble_compiled,
                                                     one_f_one_b=settings.zero_bubble_1f1b)
        if "zero_bubble" in sections and args.world >= 2 else [],
        "checkpointing": checkpointing.checkpoint_specs(args.world, settings.checkpoint_bench, out)
        if "checkpointing" in sections and args.world >= 2 else [],
        "experts": experts.expert_specs(settings.experts_rounds, steps=settings.experts_steps,
                                        balance_steps=settings.experts_balance_steps)
        if "experts" in sections and args.world >= experts.RANKS and settings.experts_rounds else [],
        "long_context": long_context.long_context_specs(cp_seq_len=settings.long_context_seq_len, steps=3,
                                                        longest_cap=settings.long_context_longest_cap)
        if "long_context" in sections and args.world >= long_context.RANKS and settings.long_context_seq_len else [],
    }
    runnable = len({plan.run_key(s) for group in specs.values() for s in group if not s.meta.get("skipped")})
    # The search decides; about 3 doublings past the start and log2(1 / resolution) bisections per precision.
    trials = 3 + math.ceil(math.log2(1 / settings.memory_resolution))
    memory_estimate = len(plan.PRECISIONS) * trials if "memory" in sections and args.world >= 2 else 0
    progress = Progress(runnable + memory_estimate)
    results = {
        "command": "python run.py study " + " ".join(argv), "mode": mode,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
        "settings": {"model": vars(settings.model), "micro_batch_size": settings.micro_batch_size,
                     "microbatches": settings.microbatches, "steps": settings.steps, "rounds": settings.rounds,
                     "world": args.world, "sections": sections},
        "commands": [],
    }
    t0 = time.monotonic()
    memory_search = " + the memory search" if "memory" in sections and args.world >= 2 else ""
    print(f"study: {runnable} runs{memory_search}, writing to {out}", flush=True)

    finished: dict[tuple, RunResult] = {}  # identical runs of two sections are run once

    def run(spec: RunSpec, detail) -> dict:
        key = plan.run_key(spec)
        if key in finished and finished[key].ok:
            earlier = finished[key]
            print(f"[reused] {spec.name}: the same run as {earlier.name}", flush=True)
            return {**earlier.to_dict(meta=spec.meta), "reused_from": earlier.name}
        result = execute(spec, out, timeout=settings.timeout_s)
        finished[key] = result
        results["commands"].append(result.command)
        progress.report(result, detail(result) if result.ok else "")
        _save(out, results)
        return result.to_dict()

    if specs["throughput"]:
        raw = []
        for spec in specs["throughput"]:
            if spec.meta.get("skipped"):
                raw.append({"name": spec.name, "ok": False, "summary": None, "error": None, **spec.meta})
                continue
            raw.append(run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s"))
        results["throughput"] = {"runs": raw, "table": analysis.throughput_table(raw)}
        rows = analysis.time_split_rows([r for r in raw if r["ok"]])
        results["time_split"] = {"rows": rows, "method": _TIME_SPLIT_METHOD,
                                 "bottlenecks": analysis.bottleneck_sentences(rows)}
        results["timelines"] = _collect_timelines(raw, out)
    if "memory" in sections and args.world >= 2:
        results["memory"] = _memory_section(settings, budget_gb, out, run)
    if specs["scaling"]:
        raw = [run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s") for spec in specs["scaling"]]
        results["scaling"] = {"runs": raw, "table": analysis.scaling_table(raw)}
    if specs["overhead"]:
        raw = [run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s") for spec in specs["overhead"]]
        results["overhead"] = {"runs": raw, "summary": analysis.overhead_summary(raw)}

    if specs["split"]:
        layer_seconds = _split_layer_seconds(settings)
        raw = [run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s, blocks {r.summary['blocks_per_stage']}")
               for spec in specs["split"]]
        results["split"] = {"runs": raw, "table": analysis.split_table(raw, layer_seconds=layer_seconds),
                            "model": vars(settings.split_model), "layer_seconds": layer_seconds}

    if specs["sharding"]:
        raw = [run(spec, lambda r: f"peak tensor memory {(r.summary['peak_tensor_bytes'] or 0) / 2**30:.3f} GiB, "
                                   f"resident {r.summary['peak_bytes'] / 2**30:.3f} GiB per rank")
               for spec in specs["sharding"]]
        results["sharding"] = {"runs": raw, "table": sharding.memory_table(raw, settings.sharding_model),
                               "model": vars(settings.sharding_model), "method": sharding.MEMORY_METHOD}
    if specs["replicate"]:
        raw = [run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s") for spec in specs["replicate"]]
        results["replicate"] = {"runs": raw, "summary": sharding.replicate_summary(raw), "method": (
            f"2 ranks, model {vars(settings.replicate_model)}, fp32, global batch 32 in micro-batches of 4, "
            f"{settings.steps + 1} steps per run, {settings.replicate_rounds} alternated repetitions (order reversed "
            "every other one); samples/s pooled as the median over the steady steps of every repetition.")}

    if specs["zero_bubble"]:
        raw = [run(spec, lambda r: f"{r.summary['samples_per_sec']:.3f} samples/s") for spec in specs["zero_bubble"]]
        shape = settings.zero_bubble_model
        results["zero_bubble"] = {"runs": raw, "table": zero_bubble.zero_bubble_summary(raw),
                                  "model": f"{shape.layers} x d {shape.d_model}", "method": (
            f"pp=2 on 2 ranks, model {vars(shape)}, fp32, {zero_bubble.MICROBATCHES} "
            f"micro-batches of {zero_bubble.MICRO_BATCH_SIZE}, {settings.steps + 1} steps per run, "
            f"{settings.zero_bubble_rounds} alternated repetitions; samples/s pooled as the median over the steady "
            "steps of every repetition. The bound is the bubble formulas' (compiler/schedules.py).")}

    if specs["checkpointing"]:
        raw = []
        for spec in specs["checkpointing"]:
            raw.append(run(spec, lambda r: f"{r.summary['train_time_s']:.1f} s, pauses "
                                           + ", ".join(f"{p:.2f}" for p in r.summary["checkpoint_pauses_s"].values())))
            checkpointing.remove_checkpoints(out, spec)
        bench = settings.checkpoint_bench
        results["checkpointing"] = {"runs": raw, "summary": checkpointing.checkpoint_summary(raw), "method": (
            f"{raw[0]['mesh']} mesh; pause runs: flags {' '.join(bench.model_flags)}, fp32, 4 micro-batches of 1, "
            f"{bench.steps} steps, a checkpoint every {bench.every} (keep 1), {bench.rounds} alternated repetition(s). "
            + (f"Steady-memory runs: --model tiny fp16, {bench.steady_steps} steps, background checkpoints every "
               f"{bench.steady_every}, peak resident memory logged every {bench.steady_every} steps. "
               if bench.steady_steps else "Peak resident memory from the pause runs. ")
            + checkpointing.METHOD)}

    if specs["experts"]:
        raw = [run(spec, lambda r: f"{r.summary['tokens_per_sec']:.0f} tokens/s") for spec in specs["experts"]]
        results["experts"] = {"runs": raw, "summary": experts.expert_summary(raw), "method": (
            experts.__doc__.strip().split("\n\n")[1].replace("\n", " ") + f" {settings.experts_steps} steps per timed run, "
            f"{settings.experts_rounds} alternated repetition(s), medians; {settings.experts_balance_steps} steps per "
            "balance run.")}

    if specs["long_context"]:
        raw = [run(spec, lambda r: f"{r.summary['tokens_per_sec']:.0f} tokens/s") for spec in specs["long_context"]]
        results["long_context"] = {"runs": raw, "summary": long_context.long_context_summary(raw), "method": (
            long_context.__doc__.strip().split("\n\n")[1].replace("\n", " ")
            + f" cp rows at T {settings.long_context_seq_len}; 3 steps per run, the median of the last two.")}

    results["wall_time_s"] = time.monotonic() - t0
    results["targets"] = report.targets(results)  # only those of the sections that ran
    results["charts"] = charts.write_charts(results, out)
    _save(out, results)
    (out / "commands.txt").write_text("\n".join(results["commands"]) + "\n")
    (out / "REPORT.md").write_text(report.render(results, cores=os.cpu_count() or 1))
    hparams.write_hparams(results, out)
    print(f"study done in {results['wall_time_s'] / 60:.1f} min: {out / 'REPORT.md'}", flush=True)
    for t in results["targets"]:
        print(f"  target {t['target']}: {t['measured']} ({t['goal']}) {'met' if t['met'] else 'NOT met'}")
    return 0


_TIME_SPLIT_METHOD = (
    "Timing hooks around every pipeline action and collective (runtime/profiling.py), on the last 3 steps of each "
    "run, averaged. forward/backward = a stage's compute (backward includes input- and weight-gradient passes); "
    "pipeline send/receive = posting p2p operations and waiting for sends; idle = waiting for a neighbour's "
    "activation or gradient (the bubble; on gloo the transfer itself is inside this wait); TP/DP = DTensor and "
    "FSDP collectives, nested time removed from compute; optimizer = unscale, global-norm all-reduce, clip, AdamW; "
    "other = the untracked remainder. 'tracked' is the share of the step the categories explain. With more ranks "
    "than cores, compute wall time includes time-slicing between ranks."
)


def _split_layer_seconds(settings: plan.StudySettings) -> list[float]:
    """Measured forward + backward seconds of the split model's [embedding, blocks..., head] at the
    benchmark's micro-batch, on one thread as a rank runs them: what the stages really cost. The head's
    includes its loss, whose softmax over the vocabulary counts no FLOPs, so this is the cap the report
    sets beside the FLOP-based expectation."""
    cfg = settings.split_model.config()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers = measure_layer_times(cfg, micro_batch_size=settings.split_micro_batch_size or settings.micro_batch_size,
                                     precision="fp32", device=select_device(0), repeats=5)
    finally:
        torch.set_num_threads(threads)
    return [c.seconds for c in layers]


def _memory_section(settings, budget_gb: float, out: Path, run) -> dict:
    budget = budget_gb * 1024**3
    search = {}
    for precision in plan.PRECISIONS:  # fp32 first
        trials = []
        # fp16 and bf16 need less memory per sample: their search starts at the fp32 maximum, which saves
        # the small trials (and fp16 runs slowly on CPUs without fp16 arithmetic).
        start = max(settings.memory_start, search["fp32"]["max_micro_batch"]) if search else settings.memory_start

        def fits(mbs: int) -> bool:
            r = run(plan.memory_spec(settings, precision=precision, micro_batch_size=mbs),
                    lambda res: f"peak tensor memory {res.summary['peak_tensor_bytes'] / 1024**3:.3f} GB of "
                                f"{budget_gb:.3f} GB (resident {res.summary['peak_bytes'] / 1024**3:.3f} GB)")
            peak = r["summary"]["peak_tensor_bytes"] if r["ok"] else None
            trials.append({"micro_batch_size": mbs, "peak_gb": peak / 1024**3 if peak else None,
                           "resident_gb": r["summary"]["peak_bytes"] / 1024**3 if r["ok"] else None, "ok": r["ok"]})
            return r["ok"] and peak <= budget

        result = search_max_batch(fits, start=start, resolution=settings.memory_resolution)
        at_max = next((t["peak_gb"] for t in trials if t["micro_batch_size"] == result.max_fitting), None)
        search[precision] = {"max_micro_batch": result.max_fitting, "first_failing": result.first_failing,
                             "peak_gb_at_max": at_max, "trials": trials}
    fp32 = search["fp32"]["max_micro_batch"]

    def ratio_range(name: str) -> list[float] | None:
        """The true ratio lies between fit/fail bounds of the two searches."""
        low, high = search[name], search["fp32"]
        if not (fp32 and low["first_failing"] and high["first_failing"]):
            return None
        return [low["max_micro_batch"] / high["first_failing"], low["first_failing"] / high["max_micro_batch"]]

    is_cuda = has_accelerator()
    method = (
        f"Per-rank budget {budget_gb:.3f} GB of tensor memory. Each trial is a real 2-step training run (pp=2 on "
        f"2 ranks, 1F1B, 2 micro-batches, model {vars(settings.memory_model)}, `--profile-memory`); the micro-batch "
        f"is doubled from {settings.memory_start} (fp32) or from the fp32 maximum (fp16, bf16) until a trial fails, "
        "then bisected. A trial fails when it errors (on CUDA: runs out of "
        "memory) or when its measured peak tensor memory, the maximum over ranks, exceeds the budget. "
        + ("On CUDA the peak is max_memory_allocated."
           if is_cuda else
           "On CPU nothing runs out of memory at a budget and the allocator keeps no statistics, so the peak is "
           "measured from the allocator's own allocation and free events (torch.profiler with profile_memory) "
           "during the second step, added to the bytes live when the step starts (parameters, AdamW state, "
           "batch): the CPU counterpart of max_memory_allocated. Measured, not computed from a formula. The peak "
           "resident set size of each trial is listed too; it also counts the interpreter, libraries and kernel "
           "scratch space (the CPU's slow fp16 matmul fallback allocates extra scratch outside the tensor "
           "allocator).")
    )
    return {"budget_gb": budget_gb, "method": method, "search": search,
            "fp16_over_fp32": search["fp16"]["max_micro_batch"] / fp32 if fp32 else None,
            "bf16_over_fp32": search["bf16"]["max_micro_batch"] / fp32 if fp32 else None,
            "fp16_over_fp32_bounds": ratio_range("fp16"), "bf16_over_fp32_bounds": ratio_range("bf16")}


def _collect_timelines(raw: list[dict], out: Path) -> dict:
    """Timelines at pp=2 of every schedule that ran (the bubble shrinking from naive to zero-bubble),
    copied next to the report."""
    timelines = {}
    folder = out / "timelines"
    folder.mkdir(exist_ok=True)
    for label, _, _ in plan.THROUGHPUT_SCHEDULES:
        run = next((r for r in reversed(raw) if r.get("group") == "pp=2" and r.get("label") == label and r["ok"]), None)
        if run is None:
            continue
        src = out / run["name"]
        stem = label.replace(" ", "_").replace("=", "")
        for ext in ("png", "json"):
            shutil.copy(src / f"timeline.{ext}", folder / f"{stem}.{ext}")
        timelines[label] = {"png": f"timelines/{stem}.png", "trace": f"timelines/{stem}.json"}
    return timelines


def _machine() -> dict:
    device = select_device(0)
    return {"device": device_description(device), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _save(out: Path, results: dict) -> None:
    write_json(out / "results.json", results, indent=2, default=str)
