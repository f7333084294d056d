"""The overlapped schedules against the naive loop, and compiled blocks against eager, at pp=2.

pp=2 on 2 ranks, 8 blocks of d 256, sequence 128, fp32, 8 micro-batches of 4: ``naive`` (stop-and-wait),
``zbv`` (ZB-V, rank r holding stages r and 3-r), ``interleaved-1f1b`` v=2 (the default) and ``1f1b``,
alternated in every repetition against the machine's drift. The bubble formulas bound zbv at 2.0x the naive loop
(ideal F = B = W) and interleaved v=2 at 1.88x; what zbv loses to its bound is the split backward's cost
(an input- and a weight-gradient pass per micro-batch instead of one backward) and F, B and W not being
equal.

With ``compiled``, interleaved-1f1b v=2 also runs with ``--compile`` (inductor per block): on this CPU a
quick test measured 0.93-0.97x of eager (ENGINEERING_NOTES.md), so the row records what compilation gives
here rather than a target; the first step, which compiles, is excluded like every warm-up step.
"""

from __future__ import annotations

from compiler.schedules import ideal_speedup_over_naive
from runtime.commands.flags import model_flags
from runtime.commands.launch import RunSpec
from runtime.lab.study.analysis import pooled_samples_per_sec, ratio_by_round

# (label, --schedule, v, extra flags)
CONTENDERS = (("naive", "naive", 1, ()), ("zbv", "zbv", 2, ()), ("interleaved-1f1b v=2", "interleaved-1f1b", 2, ()))
ONE_F_ONE_B = ("1f1b", "1f1b", 1, ())  # the full study's: --quick and --smoke have 1f1b in their throughput section
# The overlap targets on this model (issue 27): each schedule's samples/s over naive's, pooled over repetitions.
TARGETS = {"zbv": 1.85, "interleaved-1f1b v=2": 1.80, "1f1b": 1.70}
COMPILED = ("interleaved-1f1b v=2 --compile", "interleaved-1f1b", 2, ("--compile",))
PP, MICROBATCHES, MICRO_BATCH_SIZE = 2, 8, 4


def contenders(compiled: bool, one_f_one_b: bool = True) -> tuple:
    return (*CONTENDERS, *[ONE_F_ONE_B] * one_f_one_b, *[COMPILED] * compiled)


def zero_bubble_specs(rounds: int, model, *, steps: int, compiled: bool = False,
                      one_f_one_b: bool = True) -> list[RunSpec]:
    """The alternated runs of ``model`` (a family config) under each contender, ``rounds`` times."""
    common = [*model_flags(model), "--dp", "1", "--pp", str(PP), "--mp", "1", "--micro-batch-size",
              str(MICRO_BATCH_SIZE), "--microbatches", str(MICROBATCHES), "--precision", "fp32", "--data", "synthetic",
              "--steps", str(steps), "--log-every", str(steps), "--eval-every", "0", "--eval-batches", "1", "--seed", "1234"]
    specs = []
    for r in range(rounds):
        order = contenders(compiled, one_f_one_b)
        for label, schedule, v, extra in order if r % 2 == 0 else order[::-1]:
            meta = {"section": "zero_bubble", "label": label, "schedule": schedule, "v": v, "round": r}
            args = [*common, "--schedule", schedule, "--stages-per-rank", str(v), *extra]
            name = f"zero_bubble_{schedule}{'_compiled' if extra else ''}_r{r}"
            specs.append(RunSpec(name, PP, args, meta=meta))
    return specs


def zero_bubble_summary(runs: list[dict]) -> list[dict]:
    """Per contender: samples/s pooled over repetitions, its ratio to naive overall and per repetition,
    and the bound its bubble formula gives."""
    naive = pooled_samples_per_sec([r for r in runs if r["label"] == "naive"])
    rows = []
    ran = {r["label"] for r in runs}
    for label, schedule, v, _ in contenders(COMPILED[0] in ran, ONE_F_ONE_B[0] in ran):
        rate = pooled_samples_per_sec([r for r in runs if r["label"] == label])
        rows.append({"label": label, "schedule": schedule, "samples_per_sec": rate,
                     "speedup_vs_naive": rate / naive if rate and naive else None,
                     "speedup_by_round": ratio_by_round(runs, lambda r, x=label: r["label"] == x,
                                                        lambda r: r["label"] == "naive"),
                     "bound": ideal_speedup_over_naive(schedule, p=PP, m=MICROBATCHES, v=v)})
    return rows


def zero_bubble_markdown(section: dict) -> list[str]:
    def fmt(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    lines = ["## Zero-bubble V (zbv) against the naive loop, and compiled blocks", "", section["method"], "",
             "| schedule | samples/s (pooled) | vs naive | per repetition | bound |", "| --- | --- | --- | --- | --- |"]
    for r in section["table"]:
        by_round = ", ".join(f"{x:.2f}x" for x in r["speedup_by_round"]) or "n/a"
        lines.append(f"| {r['label']} | {fmt(r['samples_per_sec'])} | {fmt(r['speedup_vs_naive'], '.3f')}x | "
                     f"{by_round} | {r['bound']:.2f}x |")
    return lines + [""]
