"""REPORT.md: tables, targets and conclusions, all computed from the study's measurements."""

from __future__ import annotations

from runtime.lab.study import charts, checkpointing, experts, long_context, sharding, zero_bubble
from runtime.observe.profiling import CATEGORIES

TARGETS = (
    ("interleaved-1f1b (v=2) vs naive, pp=2, fp32", "interleaved-1f1b v=2", 1.80),
    ("1f1b vs naive, pp=2, fp32", "1f1b", 1.70),
)


def _fmt(x, spec=".2f", none="n/a") -> str:
    return none if x is None else format(x, spec)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ratios(by_round: list[float]) -> str:
    return ", ".join(f"{x:.2f}x" for x in by_round)


def _measured(value: float | None, by_round: list[float] | None, spec: str = ".3f") -> str:
    """The pooled ratio, and each repetition's own ratio when there are several (the machine's noise)."""
    if not value:
        return "n/a"
    text = _fmt(value, spec) + "x"
    if by_round and len(by_round) > 1:
        text += f" (repetitions: {_ratios(by_round)})"
    return text


def ran(results: dict, section: str) -> bool:
    """Whether the study was asked for ``section`` and recorded it: a study of some sections reports only those."""
    asked = results.get("settings", {}).get("sections")
    return section in results and (asked is None or section in asked)


def _target(name: str, goal: float, measured: str, value: float | None) -> dict:
    return {"target": name, "goal": f">= {goal:.2f}x", "measured": measured, "met": bool(value and value >= goal)}


def targets(results: dict) -> list[dict]:
    """The performance targets of the sections that ran, each with its measured figure."""
    rows = []
    if ran(results, "throughput"):
        throughput = [r for r in results["throughput"].get("table", []) if r["group"] == "pp=2"]
        for name, label, goal in TARGETS:
            row = next((r for r in throughput if r["label"] == label), {})
            value = row.get("speedup_vs_naive")
            rows.append(_target(name, goal, _measured(value, row.get("speedup_by_round")), value))
    split = ({(r.get("schedule", "1f1b"), r["pp"]): r for r in results.get("split", {}).get("table", [])}
             if ran(results, "split") else {})
    if ("1f1b", 4) in split:
        row = split[("1f1b", 4)]
        ratio = row.get("auto_over_uniform")
        rows.append(_target("--split auto vs uniform, heavy LM head, pp=4", 1.15,
                            _measured(ratio, row.get("auto_over_uniform_by_round")), ratio))
    expected = split.get(("zbv", 4), {}).get("measured_expected_on_cores")
    if expected:
        # "The margin its stage costs predict, within noise": the ratio the measured layer times predict on
        # this machine's cores, less 5% (a single run's ratio moves by about that much here).
        row = split[("zbv", 4)]
        ratio = row.get("auto_over_uniform")
        rows.append(_target(f"V-aware split vs uniform V split (zbv), heavy LM head, pp=4 (predicted {expected:.2f}x)",
                            0.95 * expected, _measured(ratio, row.get("auto_over_uniform_by_round")), ratio))
    if ran(results, "overhead"):
        ratio = results["overhead"].get("summary", {}).get("engine_over_plain")
        rows.append(_target("engine 1x1x1 within 5% of a plain PyTorch loop", 0.95,
                            _fmt(ratio, ".3f") + "x" if ratio else "n/a", ratio))
    if ran(results, "memory"):
        ratio = results["memory"].get("fp16_over_fp32")
        rows.append(_target("fp16 max micro-batch vs fp32, same budget", 1.60,
                            _fmt(ratio, ".2f") + "x" if ratio else "n/a", ratio))
    if ran(results, "replicate"):
        s = results["replicate"]["summary"]
        ratio = s.get("replicate_over_ddp")
        rows.append(_target("--dp 2 --dp-shard 1 vs a plain DDP loop, 2 ranks", 1.00,
                            _measured(ratio, s.get("replicate_over_ddp_by_round")), ratio))
    if ran(results, "zero_bubble"):
        model = results["zero_bubble"].get("model", "8 x d 256")  # the targets are set on the full study's 8 x d 256
        for label, goal in zero_bubble.TARGETS.items():
            row = next((r for r in results["zero_bubble"]["table"] if r["label"] == label), None)
            if row is None:  # results written before the section ran that schedule
                continue
            value = row.get("speedup_vs_naive")
            rows.append(_target(f"{label} vs naive, pp=2, {model}, fp32", goal,
                                _measured(value, row.get("speedup_by_round")), value))
    return rows


def conclusions(results: dict, *, cores: int) -> list[str]:
    out = []
    table = results.get("throughput", {}).get("table", [])
    for group in dict.fromkeys(r["group"] for r in table):
        rows = [r for r in table if r["group"] == group and r.get("samples_per_sec")]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["samples_per_sec"])
        naive = next((r for r in rows if r["label"] == "naive"), None)
        if naive and best is not naive:
            out.append(
                f"{group}: the fastest schedule is {best['label']} at {best['samples_per_sec']:.2f} samples/s, "
                f"{best['speedup_vs_naive']:.2f}x the stop-and-wait loop (bound {best['theoretical_speedup']:.2f}x, "
                f"{100 * best['speedup_vs_naive'] / best['theoretical_speedup']:.0f}% of it); measured idle "
                f"{_pct(naive['measured_idle_fraction'])} under naive vs {_pct(best['measured_idle_fraction'])}.")
            if best.get("compute_slowdown"):
                out.append(
                    f"{group}: under {best['label']} each rank's forward + backward took {best['compute_slowdown']:.2f}x "
                    f"its time under naive (ranks computing at once share the machine), so the bound at that compute "
                    f"speed is {best['bound_at_measured_compute']:.2f}x; the schedule reached "
                    f"{100 * best['speedup_vs_naive'] / best['bound_at_measured_compute']:.0f}% of it.")
        above = [r for r in rows if r["speedup_vs_naive"] and r["speedup_vs_naive"] > r["theoretical_speedup"]]
        naive_reps = [x for x in results["throughput"]["runs"]
                      if x.get("group") == group and x.get("label") == "naive" and x["ok"]]
        if above and len(naive_reps) > 1:
            rates = [x["summary"]["samples_per_sec"] for x in naive_reps]
            spread = (max(rates) - min(rates)) / min(rates)
            out.append(f"{group}: {', '.join(r['label'] for r in above)} measured above the bubble bound; the bound "
                       f"assumes every stage computes as fast as under naive, and this machine's run-to-run noise "
                       f"is of that order (the naive repetitions differ by {100 * spread:.1f}%).")
        busy = _ranks_computing(results, group, "naive")
        if busy is not None and busy >= 0.9 * cores:
            out.append(
                f"{group}: even stop-and-wait keeps {busy:.1f} ranks computing at once on {cores} cores, so overlap "
                f"has little idle time left to reclaim here; the cores, not the pipeline, bound throughput.")
    for row in results.get("time_split", {}).get("bottlenecks", []):
        out.append(row)
    scaling = results.get("scaling", {}).get("table", [])
    good = [r for r in scaling if r.get("efficiency_vs_cores") and r["world"] > 1 and r["efficiency_vs_cores"] >= 0.7]
    bad = [r for r in scaling if r.get("efficiency_vs_cores") is not None and r["world"] > 1 and r["efficiency_vs_cores"] < 0.7]
    if good:
        out.append("Scales (>= 70% of the speed-up the cores allow): " + ", ".join(
            f"{r['kind']} {r['mesh']} ({_pct(r['efficiency_vs_cores'])}, compute/comm {_fmt(r['compute_to_comm'], '.1f', 'inf')})"
            for r in good) + ".")
    if bad:
        worst = min(bad, key=lambda r: r["efficiency_vs_cores"])
        out.append("Does not scale: " + ", ".join(
            f"{r['kind']} {r['mesh']} ({_pct(r['efficiency_vs_cores'])}, compute/comm {_fmt(r['compute_to_comm'], '.1f', 'inf')},"
            f" idle {_pct(r['idle_fraction'])})" for r in bad) +
            f". The worst, {worst['kind']} {worst['mesh']}, spends {_pct(worst['comm_fraction'])} of its step in "
            f"communication and {_pct(worst['idle_fraction'])} idle.")
    if any(r["world"] > cores for r in scaling):
        out.append(f"This machine has {cores} cores: beyond {cores} ranks, ranks time-share cores, so the ideal "
                   f"speed-up is {cores}x, not the rank count; efficiency is reported against both.")
    memory = results.get("memory", {})
    if memory.get("fp16_over_fp32"):
        out.append(f"Under a {memory['budget_gb']:.3f} GB per-rank tensor-memory budget, fp16 autocast fits "
                   f"{memory['fp16_over_fp32']:.2f}x the fp32 micro-batch and bf16 {_fmt(memory.get('bf16_over_fp32'))}x.")
    overhead = results.get("overhead", {}).get("summary", {})
    if overhead.get("engine_over_plain"):
        out.append(f"At 1x1x1 the engine runs at {overhead['engine_over_plain']:.3f}x the speed of a plain PyTorch loop "
                   f"on the same model and batch.")
    return out


def _ranks_computing(results: dict, group: str, label: str) -> float | None:
    rows = [r for r in results.get("time_split", {}).get("rows", []) if r["group"] == group and r["label"] == label]
    return sum(r["forward"] + r["backward"] for r in rows) if rows else None


def render(results: dict, *, cores: int) -> str:
    lines = ["# Performance study", ""]
    m = results["machine"]
    lines += [f"- Machine: {m['device']}; torch {m['torch']}; Python {m['python']}; {m['cores']} cores",
              f"- Date: {results['started']}; wall time {results['wall_time_s'] / 60:.1f} min; mode: {results['mode']}",
              f"- Command: `{results['command']}`", ""]
    s = results["settings"]
    lines += [f"Model for throughput, time split, scaling and overhead: {s['model']}; micro-batch {s['micro_batch_size']}, "
              f"{s['microbatches']} micro-batches, {s['steps']} steps per run (median of the steps after warm-up), "
              "fp32, synthetic tokens. Every run is a real `torchrun` training job; commands are listed at the end "
              "and in commands.txt.", ""]
    if results["mode"] in ("quick", "smoke") and targets(results):
        lines += [f"{results['mode'].capitalize()} mode: a small model whose steps are dominated by fixed per-action "
                  "costs. The performance targets are defined for a model big enough that compute dominates: run "
                  "the full study (without --quick or --smoke) to check them.", ""]
    lines += _targets_section(results) + _throughput_section(results) + _memory_section(results)
    lines += _time_split_section(results) + _timeline_section(results) + _scaling_section(results)
    lines += _overhead_section(results) + _split_section(results)
    if ran(results, "sharding"):
        lines += sharding.memory_markdown(results["sharding"]) + charts.markdown(results, "sharding")
    if ran(results, "replicate"):
        lines += sharding.replicate_markdown(results["replicate"])
    if ran(results, "zero_bubble"):
        lines += zero_bubble.zero_bubble_markdown(results["zero_bubble"])
    if ran(results, "experts"):
        lines += experts.experts_markdown(results["experts"])
    if ran(results, "long_context"):
        lines += long_context.long_context_markdown(results["long_context"])
    if ran(results, "checkpointing"):
        lines += checkpointing.checkpoint_markdown(results["checkpointing"])
    found = conclusions(results, cores=cores)
    if found:
        lines += ["## Conclusions", ""] + [f"- {c}" for c in found] + [""]
    lines += ["## Commands", "", "```"] + results.get("commands", []) + ["```", ""]
    return "\n".join(lines)


def _targets_section(results: dict) -> list[str]:
    rows = targets(results)
    if not rows:
        return []
    lines = ["## Targets", "", "| target | goal | measured | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['goal']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in rows]
    return lines + [""]


def _repetitions(row: dict) -> str:
    """How many runs were pooled, and each repetition's own speed-up over naive when there are several."""
    by_round = row.get("speedup_by_round") or []
    if len(by_round) < 2:
        return str(row["repetitions"])
    return f"{row['repetitions']} ({_ratios(by_round)})"


def _throughput_section(results: dict) -> list[str]:
    if not ran(results, "throughput"):
        return []
    lines = ["## 1. Throughput against the naive baseline", "",
             "Speed-up bound from the bubble fractions: (1 - bubble) / (1 - (p-1)/p), with bubble (p-1)/(m+p-1) for "
             "GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B (Narayanan et al. 2021) and ~0 for zero-bubble "
             "(Qi et al. 2024).", "",
             "The bound assumes a stage computes as fast while its neighbours compute as it does alone under naive. "
             "'compute vs naive' is the measured forward + backward time per rank under the schedule over that under "
             "naive (ranks sharing memory bandwidth and caches compute slower together); 'bound at that compute' is "
             "the bound divided by it: what the schedule could reach with this machine's concurrent compute speed.", "",
             "Every mesh trains the same global batch: m micro-batches per replica of mbs samples each.", "",
             "| mesh | schedule | p | m | v | mbs | samples/s | tokens/s | speed-up vs naive | bound | compute vs naive | "
             "bound at that compute | idle (measured) | bubble (theory) | runs (speed-up of each repetition) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results.get("throughput", {}).get("table", []):
        head = f"| {r['group']} | {r['label']} | {r['p']} | {r['m']} | {r['v']} | {r.get('micro_batch_size') or ''} |"
        if r.get("skipped") or r.get("failed"):
            lines.append(head + f" {r.get('skipped') or 'failed: ' + r['failed']} |" + " |" * 8)
            continue
        lines.append(head + f" {r['samples_per_sec']:.3f} | {r['tokens_per_sec']:.0f} | {_fmt(r['speedup_vs_naive'], '.3f')}x |"
                     f" {r['theoretical_speedup']:.3f}x | {_fmt(r.get('compute_slowdown'), '.3f')}x |"
                     f" {_fmt(r.get('bound_at_measured_compute'), '.3f')}x | {_pct(r['measured_idle_fraction'])} |"
                     f" {_pct(r['theoretical_bubble_fraction'])} | {_repetitions(r)} |")
    return lines + [""] + charts.markdown(results, "throughput")


def _memory_section(results: dict) -> list[str]:
    mem = results.get("memory")
    if not mem:
        return []
    lines = ["## 2. Memory: largest micro-batch under a per-rank budget", "", mem["method"], "",
             "| precision | max micro-batch | peak tensor GB at max | first failing | "
             "trials (micro-batch: tensor GB / resident GB) |",
             "| --- | --- | --- | --- | --- |"]
    for precision, r in mem["search"].items():
        trials = ", ".join(f"{t['micro_batch_size']}: {_fmt(t['peak_gb'], '.3f', 'fail')} / {_fmt(t['resident_gb'], '.2f', '-')}"
                           for t in r["trials"])
        lines.append(f"| {precision} | {r['max_micro_batch']} | {_fmt(r['peak_gb_at_max'], '.3f')} | "
                     f"{r['first_failing'] or 'cap'} | {trials} |")
    def bounds(key):
        b = mem.get(key)
        return f" (the search brackets the true ratio in [{b[0]:.2f}, {b[1]:.2f}])" if b else ""

    lines += ["", f"fp16 / fp32 maximum micro-batch: {_fmt(mem.get('fp16_over_fp32'))}x{bounds('fp16_over_fp32_bounds')}; "
                  f"bf16 / fp32: {_fmt(mem.get('bf16_over_fp32'))}x{bounds('bf16_over_fp32_bounds')}.", ""]
    return lines + charts.markdown(results, "memory_batch", "memory")


def _time_split_section(results: dict) -> list[str]:
    rows = results.get("time_split", {}).get("rows", [])
    if not rows:
        return []
    lines = ["## 3. Where the time goes", "", results["time_split"]["method"], "",
             "| mesh | schedule | rank | step (s) | " + " | ".join(CATEGORIES) + " | tracked | bubble (theory) |",
             "| --- | --- | --- | --- |" + " --- |" * len(CATEGORIES) + " --- | --- |"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['label']} | {r['rank']} | {r['step_time']:.3f} | "
                     + " | ".join(_pct(r[k]) for k in CATEGORIES)
                     + f" | {_pct(r['tracked_fraction'])} | {_pct(r['theoretical_bubble'])} |")
    return lines + [""] + charts.markdown(results, "time_split")


def _timeline_section(results: dict) -> list[str]:
    timelines = results.get("timelines", {})
    if not timelines:
        return []
    lines = ["## 4. Pipeline timelines", "",
             "One step, one row per rank: forward (blue), backward (green), input-gradient (teal), weight-gradient "
             "(orange), optimizer (purple); the number is the micro-batch; light grey is idle. Open the Chrome "
             "traces in https://ui.perfetto.dev or chrome://tracing; the same images are in TensorBoard "
             "(IMAGES tab, `timeline/<schedule>`).", ""]
    for label, t in timelines.items():
        lines += [f"### {label}", "", f"![{label}]({t['png']})", "", f"Chrome trace: `{t['trace']}`", ""]
    return lines


def _scaling_section(results: dict) -> list[str]:
    rows = results.get("scaling", {}).get("table", [])
    if not rows:
        return []
    lines = ["## 5. Scaling (same global batch on every mesh)", "",
             "speed-up = samples/s over the 1-rank run; efficiency = speed-up / ranks, and / min(ranks, cores); "
             "compute/comm = (forward + backward) / (p2p + TP + DP collectives) time, averaged over ranks.", "",
             "| kind | ranks | mesh (dp x pp x mp) | samples/s | speed-up | efficiency | efficiency vs cores | "
             "compute/comm | idle |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['kind']} | {r['world']} | {r['mesh']} | failed: {r['failed']} | | | | | |")
            continue
        lines.append(f"| {r['kind']} | {r['world']} | {r['mesh']} | {r['samples_per_sec']:.3f} | {_fmt(r['speedup'])}x |"
                     f" {_pct(r['efficiency'])} | {_pct(r['efficiency_vs_cores'])} | "
                     f"{_fmt(r['compute_to_comm'], '.1f', 'no comm')} |"
                     f" {_pct(r['idle_fraction'])} |")
    return lines + [""] + charts.markdown(results, "scaling", "scaling_efficiency")


def _overhead_section(results: dict) -> list[str]:
    o = results.get("overhead", {}).get("summary")
    if not o:
        return []
    return ["## Engine overhead at 1x1x1", "",
            f"Engine (traced stage, schedule, metrics) {_fmt(o['engine_samples_per_sec'], '.3f')} samples/s against a "
            f"plain PyTorch loop {_fmt(o['plain_samples_per_sec'], '.3f')} samples/s on the same model, batch and "
            f"precision: {_fmt(o['engine_over_plain'], '.3f')}x, pooled over {o['repetitions']} alternated pairs.", ""]


def _layer_times(split: dict) -> str:
    seconds = split.get("layer_seconds")
    if not seconds or len(seconds) < 3:
        return ""
    block, head = seconds[1], seconds[-1]
    return f": a block {block * 1e3:.1f} ms, the head {head * 1e3:.1f} ms = {head / block:.1f} blocks"


def _split_section(results: dict) -> list[str]:
    split = results.get("split")
    if not split:
        return []
    first = next(iter(split["runs"]), {})
    lines = ["## Cost-balanced stage split against a uniform one", "",
             f"Model {split['model']} (the LM head costs several blocks), 1F1B and ZB-V, fp32, pp ranks = pp, "
             f"{first.get('m', '?')} micro-batches of {first.get('micro_batch_size', '?')} samples, the two splits "
             "alternated in every repetition, each rank bound to a core by its stages' cost (`--bind-cores cost`, "
             "see the commands). `--split auto` balances FLOPs counted by FlopCounterMode with an exact "
             "min-max partition over [embedding, blocks, head] (the head may get a stage alone: blocks per stage "
             "ending in 0); `uniform` puts equal blocks on every stage. 'expected' is the ratio the two splits' "
             "stage costs c_s predict for a compute-bound pipeline of m micro-batches: sum(c_s) + (m - 1) x the "
             "busiest stage's c_s with a core per rank; with fewer cores than ranks, the ranks packed on the cores "
             "as `--bind-cores cost` packs them (longest first) and the busiest core's load instead. It is given "
             "from the counted FLOPs the split was made with and from each layer's forward + backward time "
             "measured on one thread of this machine (the head with its loss)" + _layer_times(split) + ". "
             "When the head alone is the busiest stage, no split can beat (uniform's last stage) / (head), "
             "whatever the balance of the others. Under ZB-V's V placement rank r runs stages r and 2p-1-r, so "
             "rank 0 holds the embedding and the head: auto minimises the busiest rank's pair of stages (then the "
             "longest stage), and a rank's load is its pair's sum.", "",
             "| schedule | pp | auto samples/s | auto blocks/stage | uniform samples/s | uniform blocks/stage | auto / uniform | "
             "per repetition | expected from FLOPs, a core per rank | from FLOPs, this machine | "
             "from measured times, a core per rank | from measured times, this machine |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in split["table"]:
        by_round = _ratios(r.get("auto_over_uniform_by_round") or []) or "n/a"
        lines.append(f"| {r.get('schedule', '1f1b')} | {r['pp']} | {_fmt(r['auto_samples_per_sec'], '.3f')} | "
                     f"{r['auto_blocks_per_stage']} | "
                     f"{_fmt(r['uniform_samples_per_sec'], '.3f')} | {r['uniform_blocks_per_stage']} | "
                     f"{_fmt(r['auto_over_uniform'], '.3f')}x | {by_round} | "
                     f"{_fmt(r.get('expected_core_per_rank'), '.2f')}x | "
                     f"{_fmt(r.get('expected_on_cores'), '.2f')}x ({r.get('cores', '?')} cores) | "
                     f"{_fmt(r.get('measured_expected_core_per_rank'), '.2f')}x | "
                     f"{_fmt(r.get('measured_expected_on_cores'), '.2f')}x |")
    return lines + [""]
