"""What a checkpoint costs training, in the foreground and with ``--async-checkpoint``, and steady memory.

Pause: the same job (fp32, a model whose state is large beside its compute: 8 x d512, vocabulary 8192,
sequence 32) trains with no checkpoints, with foreground saves every E steps, and with background
saves every E steps, alternated per repetition. A save's *pause* is the time the training loop waited
for it (runtime/checkpoint/saving.py ``Checkpointer.pauses``): the whole write, hashing and publishing in
the foreground; staging the CPU copy, then the manifest and rename, in the background. The run's last
save waits for its write by design and is left out. The loop's wall time beside the no-checkpoint run
tells what the background write costs the steps it overlaps (on 2 cores it competes with them for CPU).

Steady memory: a long fp16 run, with background checkpoints and without; peak resident memory (the
largest rank's ``ru_maxrss``, logged every N steps) early in the run, halfway and at its end. DCP starts
a new writer thread per background save and glibc gives new threads arenas of their own, up to 8 per
core: resident memory climbs by a few tens of MiB over the first saves, then levels off (measured: 2x2x2
tiny fp16, a save every 10 steps: 367 -> 394 MiB by step 170, 396 MiB at step 400).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.commands.flags import model_flags
from runtime.commands.launch import RunSpec

METHOD = ("A save's pause is the time the training loop waited for it: the whole write, hashing and publishing in "
          "the foreground; staging the CPU copy, then manifest and rename, in the background. Each run's last save "
          "waits for its write by design and is left out. Loop wall time against the run without checkpoints "
          "shows what the background write costs the steps it overlaps (on 2 cores it competes with them for "
          "CPU). Peak resident memory is the largest rank's ru_maxrss.")

# --checkpoint flags per mode
MODES = {"none": [], "foreground": [], "background": ["--async-checkpoint"]}
MESHES = {8: (2, 2, 2), 4: (1, 2, 2), 2: (1, 2, 1)}


@dataclass(frozen=True)
class CheckpointBench:
    model: Any  # the pause runs' model, a family config
    steps: int
    every: int
    rounds: int
    modes: tuple[str, ...]
    steady_steps: int | None  # None: no steady-memory runs (the smoke study)
    steady_every: int = 10  # 30 saves in 300 steps: past the point where resident memory levels off
    max_world: int = 8  # the smoke study times 2 ranks


def checkpoint_dir(out: Path, run_name: str) -> Path:
    return out / run_name / "checkpoints"


def checkpoint_specs(world: int, bench: CheckpointBench, out: Path) -> list[RunSpec]:
    dp, pp, mp = MESHES[max(w for w in MESHES if w <= min(world, bench.max_world))]
    mesh = ["--dp", str(dp), "--pp", str(pp), "--mp", str(mp)]
    nproc = dp * pp * mp
    specs = []

    def spec(name: str, mode: str, flags: list[str], *, steps: int, every: int, meta: dict) -> RunSpec:
        args = [*flags, *mesh, "--steps", str(steps), "--log-every", str(every), "--eval-every", "0",
                "--eval-batches", "1", "--data", "synthetic", "--seed", "1234"]
        if mode != "none":
            args += ["--checkpoint-dir", str(checkpoint_dir(out, name)), "--checkpoint-every", str(every),
                     "--keep-checkpoints", "1", *MODES[mode]]
        return RunSpec(name, nproc, args, meta={"section": "checkpointing", "mode": mode, "mesh": f"{dp}x{pp}x{mp}", **meta})

    pause_flags = [*model_flags(bench.model), "--precision", "fp32", "--micro-batch-size", "1", "--microbatches", "4"]
    for r in range(bench.rounds):
        for mode in bench.modes if r % 2 == 0 else bench.modes[::-1]:
            specs.append(spec(f"checkpoint_pause_{mode}_r{r}", mode, pause_flags, steps=bench.steps, every=bench.every,
                              meta={"kind": "pause", "round": r}))
    if bench.steady_steps:
        for mode in ("none", "background"):
            specs.append(spec(f"checkpoint_steady_{mode}", mode, ["--model", "tiny", "--precision", "fp16"],
                              steps=bench.steady_steps, every=bench.steady_every, meta={"kind": "steady"}))
    return specs


def remove_checkpoints(out: Path, spec: RunSpec) -> None:
    """The benchmark's checkpoints are only written to be timed (hundreds of MB each): not kept."""
    shutil.rmtree(checkpoint_dir(out, spec.name), ignore_errors=True)


def _pauses(run: dict) -> list[float]:
    """Seconds per save, the last (waited for by design) left out."""
    pauses = run["summary"]["checkpoint_pauses_s"]
    return [pauses[k] for k in sorted(pauses, key=int)[:-1]]


def checkpoint_summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["ok"]]
    pause_runs = [r for r in ok if r["kind"] == "pause"]
    none_time = {r["round"]: r["summary"]["train_time_s"] for r in pause_runs if r["mode"] == "none"}
    pause_rows = []
    for mode in MODES:
        mine = [r for r in pause_runs if r["mode"] == mode]
        if not mine:
            continue
        pauses = [p for r in mine for p in _pauses(r)] if mode != "none" else []
        slowdowns = [r["summary"]["train_time_s"] / none_time[r["round"]] for r in mine if r["round"] in none_time]
        pause_rows.append({"mode": mode, "saves": len(pauses),
                           "pause_mean_s": statistics.mean(pauses) if pauses else None,
                           "pause_max_s": max(pauses) if pauses else None,
                           "train_time_s": statistics.mean(r["summary"]["train_time_s"] for r in mine),
                           "train_time_vs_none": statistics.mean(slowdowns) if slowdowns else None,
                           "train_time_vs_none_by_round": slowdowns})
    by_mode = {row["mode"]: row for row in pause_rows}
    fg, bg = by_mode.get("foreground", {}).get("pause_mean_s"), by_mode.get("background", {}).get("pause_mean_s")
    steady_rows = []
    for r in [r for r in ok if r["kind"] == "steady"] or pause_runs:
        peaks = {int(k): v for k, v in r["summary"]["peak_bytes_by_step"].items()}
        early = min((s for s in peaks if s >= 50), default=min(peaks))  # after warm-up allocations
        last = max(peaks)
        middle = min(peaks, key=lambda s: abs(s - last / 2))
        steady_rows.append({"name": r["name"], "mode": r["mode"], "kind": r["kind"], "early_step": early,
                            "middle_step": middle, "last_step": last, "early_mib": peaks[early] / 2**20,
                            "middle_mib": peaks[middle] / 2**20, "last_mib": peaks[last] / 2**20,
                            "growth_mib": (peaks[last] - peaks[early]) / 2**20,
                            "second_half_growth_mib": (peaks[last] - peaks[middle]) / 2**20})
    return {"pause": pause_rows, "background_over_foreground_pause": bg / fg if fg and bg is not None else None,
            "steady": steady_rows}


def checkpoint_markdown(section: dict) -> list[str]:
    def fmt(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    s = section["summary"]
    lines = ["## Checkpoint pauses and steady memory", "", section["method"], "",
             "| checkpoints | saves timed | pause per save (mean, max) | loop wall time | vs none (per repetition) |",
             "| --- | --- | --- | --- | --- |"]
    for r in s["pause"]:
        pause = "-" if r["mode"] == "none" else f"{fmt(r['pause_mean_s'])} s, {fmt(r['pause_max_s'])} s"
        rounds = ", ".join(f"{x:.2f}x" for x in r["train_time_vs_none_by_round"]) or "n/a"
        lines.append(f"| {r['mode']} | {r['saves']} | {pause} | {r['train_time_s']:.1f} s | {rounds} |")
    ratio = s["background_over_foreground_pause"]
    if ratio is not None:
        lines += ["", f"A background save pauses training {ratio:.2f}x as long as a foreground one."]
    lines += ["", "| run | peak resident memory | halfway | at the end | growth: all / second half |",
              "| --- | --- | --- | --- | --- |"]
    for r in s["steady"]:
        lines.append(f"| {r['name']} | {r['early_mib']:.0f} MiB (step {r['early_step']}) | {r['middle_mib']:.0f} MiB "
                     f"(step {r['middle_step']}) | {r['last_mib']:.0f} MiB (step {r['last_step']}) | "
                     f"{r['growth_mib']:+.0f} / {r['second_half_growth_mib']:+.0f} MiB |")
    return lines + [""]
