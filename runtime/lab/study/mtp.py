"""Multi-token prediction's step-time overhead: a small DeepSeek-V3 with and without one MTP depth.

DeepSeek-V3's debug shape widened for the CPU (4 blocks of d 128, 4 heads, sequence 128: 1 dense and 3 MoE blocks, 8
experts top 2 plus a shared one, latent attention with a q LoRA rank, YaRN), fp32, one rank, 2 micro-batches of 4. The
depth is the family's next block (a mixture of experts), its 2d -> d projection and norms, and the head and loss
again (models/common/mtp.py). The two runs alternate over the repetitions (order reversed every other one); each
run's step time is the median of its steady steps, the overhead the median over repetitions of the paired ratio
(depth 1 / none).
"""

from __future__ import annotations

from statistics import median

from runtime.commands.launch import RunSpec

RANKS = 1
MODEL = ["--model", "deepseek-v3-debug", "--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "128"]
LABELS = {"no MTP": [], "MTP depth 1": ["--mtp-depth", "1"]}


def mtp_specs(rounds: int, *, steps: int) -> list[RunSpec]:
    common = ["--dp", "1", "--micro-batch-size", "4", "--microbatches", "2", "--precision", "fp32", "--data",
              "synthetic", "--eval-every", "0", "--eval-batches", "1", "--seed", "1234", "--steps", str(steps),
              "--log-every", str(steps), "--skip-memory-check"]
    specs = []
    for r in range(rounds):
        order = list(LABELS.items())
        for label, extra in order if r % 2 == 0 else order[::-1]:
            name = f"mtp_{'depth1' if extra else 'none'}_r{r}"
            specs.append(RunSpec(name, RANKS, [*MODEL, *extra, *common], meta={"section": "mtp", "label": label,
                                                                                  "round": r}))
    return specs


def mtp_summary(runs: list[dict]) -> dict:
    """Step time per label (median over repetitions) and the depth's overhead, paired per repetition."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.get("ok"):
            by_round.setdefault(r["round"], {})[r["label"]] = r["summary"]["step_time_s"]
    ratios = [times["MTP depth 1"] / times["no MTP"] for times in by_round.values() if len(times) == 2]
    steps = {label: median(t[label] for t in by_round.values() if label in t) for label in LABELS
             if any(label in t for t in by_round.values())}
    return {"step_time_s": steps, "overhead_by_round": ratios, "overhead": median(ratios) if ratios else None}


def mtp_markdown(section: dict) -> list[str]:
    s = section["summary"]
    lines = ["## Multi-token prediction: the step-time overhead of one depth", "", section["method"], "",
             "| run | step time s |", "| --- | --- |"]
    lines += [f"| {label} | {t:.4f} |" for label, t in s["step_time_s"].items()]
    if s["overhead"] is not None:
        lines += ["", f"Overhead of one depth: {s['overhead']:.3f}x (per repetition: "
                  + ", ".join(f"{x:.3f}" for x in s["overhead_by_round"]) + ")"]
    return lines + [""]
