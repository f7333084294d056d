"""``python run.py study``: the performance study in one command.

Launches real torchrun training runs one at a time and writes DIR/results.json, DIR/REPORT.md with its
SVG charts in DIR/charts/, DIR/commands.txt, every run's TensorBoard logs under DIR, and every run's
hyperparameters and figures in TensorBoard's HParams tab (DIR/hparams).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from runtime.commands.flags import HelpFormatter
from runtime.commands.launch import RunSpec
from runtime.device import device_description, select_device
from runtime.lab.study import (
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
from runtime.lab.study.plan import model_summary
from runtime.lab.study.runner import StudyRunner
from runtime.lab.study.sections import SECTION_RESULTS

SECTIONS = tuple(SECTION_RESULTS)  # the order they run in


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
    p.add_argument("--mem-budget-gb", type=float,
                   help=f"per-rank budget of peak tensor memory for the batch search (default: "
                        f"{plan.FULL.memory_budget_gb}, or {plan.QUICK.memory_budget_gb} with --quick, "
                        f"{plan.SMOKE.memory_budget_gb} with --smoke)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset of " + ", ".join(SECTIONS) + " (time split and timelines come "
                        "with throughput)")
    return p


@dataclass(frozen=True)
class StudyOptions:
    """The parsed command: which sections, on how many ranks, at which size, written where."""
    world: int
    sections: tuple[str, ...]  # as --sections lists them (they run in SECTIONS order)
    mode: str  # "smoke", "quick" or "full"
    settings: plan.StudySettings  # the mode's, with --mem-budget-gb applied
    out: Path

    @property
    def memory_search(self) -> bool:
        return "memory" in self.sections and self.world >= 2


def parse_options(argv: list[str]) -> StudyOptions:
    """The command line checked; ValueError naming the flag for a value out of range."""
    args = build_parser().parse_args(argv)
    asked = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in asked if s not in SECTIONS]
    if unknown:
        raise ValueError(f"--sections: unknown {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    if args.world not in (1, 2, 4, 8):
        raise ValueError(f"--world must be 1, 2, 4 or 8, got {args.world}")
    if args.mem_budget_gb is not None and args.mem_budget_gb <= 0:
        raise ValueError(f"--mem-budget-gb must be positive, got {args.mem_budget_gb}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = {"smoke": plan.SMOKE, "quick": plan.QUICK, "full": plan.FULL}[mode]
    settings = dataclasses.replace(settings, memory_budget_gb=args.mem_budget_gb or settings.memory_budget_gb)
    out = Path(args.out or f"tensorboard_logs/study_{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return StudyOptions(args.world, asked, mode, settings, out)


def _throughput_specs(o: StudyOptions) -> list[RunSpec]:
    return plan.throughput_specs(o.world, o.settings) if o.world >= 2 else []


def _scaling_specs(o: StudyOptions) -> list[RunSpec]:
    return plan.scaling_specs(o.world, o.settings)


def _overhead_specs(o: StudyOptions) -> list[RunSpec]:
    return plan.overhead_specs(o.settings)


def _split_specs(o: StudyOptions) -> list[RunSpec]:
    return plan.split_specs(o.world, o.settings) if o.world >= 2 else []


def _sharding_specs(o: StudyOptions) -> list[RunSpec]:
    s = o.settings
    return sharding.memory_specs(min(o.world, s.sharding_world), s.sharding_model, large=s.sharding_large,
                                 other_shapes=s.sharding_other_shapes, smoke=o.mode == "smoke")


def _replicate_specs(o: StudyOptions) -> list[RunSpec]:
    s = o.settings
    return sharding.replicate_specs(s.replicate_rounds, s.replicate_model, micro_batch_size=4, microbatches=4,
                                    steps=s.steps + 1) if o.world >= 2 else []


def _zero_bubble_specs(o: StudyOptions) -> list[RunSpec]:
    s = o.settings
    return zero_bubble.zero_bubble_specs(s.zero_bubble_rounds, s.zero_bubble_model, steps=s.steps + 1,
                                         compiled=s.zero_bubble_compiled,
                                         one_f_one_b=s.zero_bubble_1f1b) if o.world >= 2 else []


def _checkpointing_specs(o: StudyOptions) -> list[RunSpec]:
    return checkpointing.checkpoint_specs(o.world, o.settings.checkpoint_bench, o.out) if o.world >= 2 else []


def _experts_specs(o: StudyOptions) -> list[RunSpec]:
    s = o.settings
    if o.world < experts.RANKS or not s.experts_rounds:
        return []
    return experts.expert_specs(s.experts_rounds, steps=s.experts_steps, balance_steps=s.experts_balance_steps)


def _long_context_specs(o: StudyOptions) -> list[RunSpec]:
    s = o.settings
    if o.world < long_context.RANKS or not s.long_context_seq_len:
        return []
    return long_context.long_context_specs(cp_seq_len=s.long_context_seq_len, steps=3,
                                           longest_cap=s.long_context_longest_cap)


def _no_specs(o: StudyOptions) -> list[RunSpec]:
    return []  # the memory section: its batch search decides its runs as it goes


# Section -> its runs for the options (an empty list: the section does not run on this world or mode).
SECTION_SPECS: dict[str, Callable[[StudyOptions], list[RunSpec]]] = {
    "throughput": _throughput_specs, "memory": _no_specs, "scaling": _scaling_specs, "overhead": _overhead_specs,
    "split": _split_specs, "sharding": _sharding_specs, "replicate": _replicate_specs,
    "zero_bubble": _zero_bubble_specs, "checkpointing": _checkpointing_specs, "experts": _experts_specs,
    "long_context": _long_context_specs,
}


def build_specs(o: StudyOptions) -> dict[str, list[RunSpec]]:
    """The runs of every asked section, in SECTIONS order."""
    return {name: SECTION_SPECS[name](o) for name in SECTIONS if name in o.sections}


def distinct_runs(specs: dict[str, list[RunSpec]]) -> int:
    """How many runs the specs make: identical runs of two sections count once, skipped specs not at all."""
    return len({plan.run_key(s) for group in specs.values() for s in group if not s.meta.get("skipped")})


def memory_trials(o: StudyOptions) -> int:
    """An estimate (the search decides): about 3 doublings past the start and log2(1 / resolution) bisections
    per precision."""
    if not o.memory_search:
        return 0
    return len(plan.PRECISIONS) * (3 + math.ceil(math.log2(1 / o.settings.memory_resolution)))


def results_header(argv: list[str], o: StudyOptions) -> dict:
    """results.json before any run: the command, the machine and the settings; the sections add theirs."""
    s = o.settings
    return {"command": "python run.py study " + " ".join(argv), "mode": o.mode,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
            "settings": {"model": model_summary(s.model), "micro_batch_size": s.micro_batch_size,
                         "microbatches": s.microbatches, "steps": s.steps, "rounds": s.rounds, "world": o.world,
                         "sections": list(o.sections)},
            "commands": []}


def main(argv: list[str]) -> int:
    try:
        o = parse_options(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    o.out.mkdir(parents=True, exist_ok=True)
    specs = build_specs(o)
    runnable = distinct_runs(specs)
    results = results_header(argv, o)
    runner = StudyRunner(o.out, results, timeout_s=o.settings.timeout_s, expected_runs=runnable + memory_trials(o))
    print(f"study: {runnable} runs{' + the memory search' if o.memory_search else ''}, writing to {o.out}", flush=True)
    t0 = time.monotonic()
    for name, section_specs in specs.items():
        if section_specs or (name == "memory" and o.memory_search):
            results |= SECTION_RESULTS[name](section_specs, runner, o.settings)
    results["wall_time_s"] = time.monotonic() - t0
    write_outputs(results, o.out, runner)
    print(f"study done in {results['wall_time_s'] / 60:.1f} min: {o.out / 'REPORT.md'}", flush=True)
    for t in results["targets"]:
        print(f"  target {t['target']}: {t['measured']} ({t['goal']}) {'met' if t['met'] else 'NOT met'}")
    return 0


def write_outputs(results: dict, out: Path, runner: StudyRunner) -> None:
    """The targets and charts into results.json (saved), then commands.txt, REPORT.md and the HParams tab."""
    results["targets"] = report.targets(results)  # only those of the sections that ran
    results["charts"] = charts.write_charts(results, out)
    runner.save()
    (out / "commands.txt").write_text("\n".join(results["commands"]) + "\n")
    (out / "REPORT.md").write_text(report.render(results, cores=os.cpu_count() or 1))
    hparams.write_hparams(results, out)


def _machine() -> dict:
    device = select_device(0)
    return {"device": device_description(device), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
