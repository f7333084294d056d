"""Each study section's runs turned into its results: one function per section, all alike,
``(specs, runner, settings) -> {results.json key: value}`` (the throughput section also gives the time split and
the timelines). ``runner`` runs a spec once and records it (study/runner.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch

from runtime.commands.flags import model_flags
from runtime.commands.launch import RunSpec
from runtime.device import has_accelerator, select_device
from runtime.lab.study import analysis, checkpointing, experts, long_context, plan, sharding, zero_bubble
from runtime.lab.study.memory_search import search_max_batch
from runtime.lab.study.plan import StudySettings, model_summary
from runtime.lab.study.runner import StudyRunner, samples_per_sec, tokens_per_sec
from runtime.observe.layer_timing import measure_layer_times

TIME_SPLIT_METHOD = (
    "Timing hooks around every pipeline action and collective (runtime/profiling.py), on the last 3 steps of each "
    "run, averaged. forward/backward = a stage's compute (backward includes input- and weight-gradient passes); "
    "pipeline send/receive = posting p2p operations and waiting for sends; idle = waiting for a neighbour's "
    "activation or gradient (the bubble; on gloo the transfer itself is inside this wait); TP/DP = DTensor and "
    "FSDP collectives, nested time removed from compute; optimizer = unscale, global-norm all-reduce, clip, AdamW; "
    "other = the untracked remainder. 'tracked' is the share of the step the categories explain. With more ranks "
    "than cores, compute wall time includes time-slicing between ranks."
)


def throughput_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    """The throughput table, the time split of its runs and the pp=2 timelines; a skipped spec (the model too
    shallow for its stages) is recorded as a failed run with its reason."""
    raw = [{"name": s.name, "ok": False, "summary": None, "error": None, **s.meta} if s.meta.get("skipped")
           else runner.run(s, samples_per_sec) for s in specs]
    rows = analysis.time_split_rows([r for r in raw if r["ok"]])
    return {"throughput": {"runs": raw, "table": analysis.throughput_table(raw)},
            "time_split": {"rows": rows, "method": TIME_SPLIT_METHOD, "bottlenecks": analysis.bottleneck_sentences(rows)},
            "timelines": collect_timelines(raw, runner.out)}


def collect_timelines(raw: list[dict], out: Path) -> dict:
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


def memory_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    """The largest micro-batch within the budget per precision (the search makes its own runs: ``specs`` is
    empty), and the ratios of fp16 and bf16 to fp32."""
    search = {}
    for precision in plan.PRECISIONS:  # fp32 first
        # fp16 and bf16 need less memory per sample: their search starts at the fp32 maximum, which saves
        # the small trials (and fp16 runs slowly on CPUs without fp16 arithmetic).
        start = max(settings.memory_start, search["fp32"]["max_micro_batch"]) if search else settings.memory_start
        search[precision] = _search_precision(runner, settings, precision=precision, start=start)
    fp32 = search["fp32"]["max_micro_batch"]

    def ratio_range(name: str) -> list[float] | None:
        """The true ratio lies between fit/fail bounds of the two searches."""
        low, high = search[name], search["fp32"]
        if not (fp32 and low["first_failing"] and high["first_failing"]):
            return None
        return [low["max_micro_batch"] / high["first_failing"], low["first_failing"] / high["max_micro_batch"]]

    return {"memory": {"budget_gb": settings.memory_budget_gb, "method": _memory_method(settings), "search": search,
                       "fp16_over_fp32": search["fp16"]["max_micro_batch"] / fp32 if fp32 else None,
                       "bf16_over_fp32": search["bf16"]["max_micro_batch"] / fp32 if fp32 else None,
                       "fp16_over_fp32_bounds": ratio_range("fp16"), "bf16_over_fp32_bounds": ratio_range("bf16")}}


def _search_precision(runner: StudyRunner, settings: StudySettings, *, precision: str, start: int) -> dict:
    """One precision's batch search: doubling from ``start``, then bisection (study/memory_search.py)."""
    budget_gb = settings.memory_budget_gb
    trials = []

    def detail(res) -> str:
        return (f"peak tensor memory {res.summary['peak_tensor_bytes'] / 1024**3:.3f} GB of {budget_gb:.3f} GB "
                f"(resident {res.summary['peak_bytes'] / 1024**3:.3f} GB)")

    def fits(mbs: int) -> bool:
        r = runner.run(plan.memory_spec(settings, precision=precision, micro_batch_size=mbs), detail)
        peak = r["summary"]["peak_tensor_bytes"] if r["ok"] else None
        trials.append({"micro_batch_size": mbs, "peak_gb": peak / 1024**3 if peak else None,
                       "resident_gb": r["summary"]["peak_bytes"] / 1024**3 if r["ok"] else None, "ok": r["ok"]})
        return r["ok"] and peak <= budget_gb * 1024**3

    result = search_max_batch(fits, start=start, resolution=settings.memory_resolution)
    at_max = next((t["peak_gb"] for t in trials if t["micro_batch_size"] == result.max_fitting), None)
    return {"max_micro_batch": result.max_fitting, "first_failing": result.first_failing, "peak_gb_at_max": at_max,
            "trials": trials}


def _memory_method(settings: StudySettings) -> str:
    return (
        f"Per-rank budget {settings.memory_budget_gb:.3f} GB of tensor memory. Each trial is a real 2-step training "
        f"run (pp=2 on 2 ranks, 1F1B, 2 micro-batches, model {model_summary(settings.memory_model)}, "
        f"`--profile-memory`); the micro-batch is doubled from {settings.memory_start} (fp32) or from the fp32 maximum "
        "(fp16, bf16) until a trial fails, then bisected. A trial fails when it errors (on CUDA: runs out of "
        "memory) or when its measured peak tensor memory, the maximum over ranks, exceeds the budget. "
        + ("On CUDA the peak is max_memory_allocated."
           if has_accelerator() else
           "On CPU nothing runs out of memory at a budget and the allocator keeps no statistics, so the peak is "
           "measured from the allocator's own allocation and free events (torch.profiler with profile_memory) "
           "during the second step, added to the bytes live when the step starts (parameters, AdamW state, "
           "batch): the CPU counterpart of max_memory_allocated. Measured, not computed from a formula. The peak "
           "resident set size of each trial is listed too; it also counts the interpreter, libraries and kernel "
           "scratch space (the CPU's slow fp16 matmul fallback allocates extra scratch outside the tensor "
           "allocator).")
    )


def scaling_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, samples_per_sec) for spec in specs]
    return {"scaling": {"runs": raw, "table": analysis.scaling_table(raw)}}


def overhead_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, samples_per_sec) for spec in specs]
    return {"overhead": {"runs": raw, "summary": analysis.overhead_summary(raw)}}


def split_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    layer_seconds = split_layer_seconds(settings)
    raw = [runner.run(spec, lambda r: f"{samples_per_sec(r)}, blocks {r.summary['blocks_per_stage']}") for spec in specs]
    return {"split": {"runs": raw, "table": analysis.split_table(raw, layer_seconds=layer_seconds),
                      "model": model_summary(settings.split_model), "layer_seconds": layer_seconds}}


def split_layer_seconds(settings: StudySettings) -> list[float]:
    """Measured forward + backward seconds of the split model's [embedding, blocks..., head] at the
    benchmark's micro-batch, on one thread as a rank runs them: what the stages really cost. The head's
    includes its loss, whose softmax over the vocabulary counts no FLOPs, so this is the cap the report
    sets beside the FLOP-based expectation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers = measure_layer_times(settings.split_model,
                                     micro_batch_size=settings.split_micro_batch_size or settings.micro_batch_size,
                                     precision="fp32", device=select_device(0), repeats=5)
    finally:
        torch.set_num_threads(threads)
    return [c.seconds for c in layers]


def sharding_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    def detail(r) -> str:
        return (f"peak tensor memory {(r.summary['peak_tensor_bytes'] or 0) / 2**30:.3f} GiB, "
                f"resident {r.summary['peak_bytes'] / 2**30:.3f} GiB per rank")

    raw = [runner.run(spec, detail) for spec in specs]
    return {"sharding": {"runs": raw, "table": sharding.memory_table(raw, settings.sharding_model),
                         "model": model_summary(settings.sharding_model), "method": sharding.MEMORY_METHOD}}


def replicate_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, samples_per_sec) for spec in specs]
    return {"replicate": {"runs": raw, "summary": sharding.replicate_summary(raw), "method": (
        f"2 ranks, model {model_summary(settings.replicate_model)}, fp32, global batch 32 in micro-batches of 4, "
        f"{settings.steps + 1} steps per run, {settings.replicate_rounds} alternated repetitions (order reversed "
        "every other one); samples/s pooled as the median over the steady steps of every repetition.")}}


def zero_bubble_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, samples_per_sec) for spec in specs]
    model = settings.zero_bubble_model
    return {"zero_bubble": {"runs": raw, "table": zero_bubble.zero_bubble_summary(raw),
                            "model": f"{model.n_layers} x d {model.d_model}", "method": (
        f"pp=2 on 2 ranks, model {model_summary(model)}, fp32, {zero_bubble.MICROBATCHES} "
        f"micro-batches of {zero_bubble.MICRO_BATCH_SIZE}, {settings.steps + 1} steps per run, "
        f"{settings.zero_bubble_rounds} alternated repetitions; samples/s pooled as the median over the steady "
        "steps of every repetition. The bound is the bubble formulas' (compiler/schedules.py).")}}


def checkpointing_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    def detail(r) -> str:
        return f"{r.summary['train_time_s']:.1f} s, pauses " + ", ".join(
            f"{p:.2f}" for p in r.summary["checkpoint_pauses_s"].values())

    raw = []
    for spec in specs:
        raw.append(runner.run(spec, detail))
        checkpointing.remove_checkpoints(runner.out, spec)
    bench = settings.checkpoint_bench
    return {"checkpointing": {"runs": raw, "summary": checkpointing.checkpoint_summary(raw), "method": (
        f"{raw[0]['mesh']} mesh; pause runs: flags {' '.join(model_flags(bench.model))}, fp32, 4 micro-batches of 1, "
        f"{bench.steps} steps, a checkpoint every {bench.every} (keep 1), {bench.rounds} alternated repetition(s). "
        + (f"Steady-memory runs: --model tiny fp16, {bench.steady_steps} steps, background checkpoints every "
           f"{bench.steady_every}, peak resident memory logged every {bench.steady_every} steps. "
           if bench.steady_steps else "Peak resident memory from the pause runs. ")
        + checkpointing.METHOD)}}


def experts_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, tokens_per_sec) for spec in specs]
    return {"experts": {"runs": raw, "summary": experts.expert_summary(raw), "method": (
        _method_paragraph(experts.__doc__) + f" {settings.experts_steps} steps per timed run, "
        f"{settings.experts_rounds} alternated repetition(s), medians; {settings.experts_balance_steps} steps per "
        "balance run.")}}


def long_context_results(specs: list[RunSpec], runner: StudyRunner, settings: StudySettings) -> dict:
    raw = [runner.run(spec, tokens_per_sec) for spec in specs]
    return {"long_context": {"runs": raw, "summary": long_context.long_context_summary(raw), "method": (
        _method_paragraph(long_context.__doc__)
        + f" cp rows at T {settings.long_context_seq_len}; 3 steps per run, the median of the last two.")}}


def _method_paragraph(doc: str) -> str:
    """A section module's second docstring paragraph (its method), on one line."""
    return doc.strip().split("\n\n")[1].replace("\n", " ")


# Section name (as --sections names it) -> the function that runs it; in the order the study runs them.
SECTION_RESULTS: dict[str, Callable[[list[RunSpec], StudyRunner, StudySettings], dict]] = {
    "throughput": throughput_results, "memory": memory_results, "scaling": scaling_results,
    "overhead": overhead_results, "split": split_results, "sharding": sharding_results,
    "replicate": replicate_results, "zero_bubble": zero_bubble_results, "checkpointing": checkpointing_results,
    "experts": experts_results, "long_context": long_context_results,
}
