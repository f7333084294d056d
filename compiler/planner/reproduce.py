"""Published large-scale runs priced by the GPU model: Table 1 of Narayanan et al., SC'21 (Megatron-LM,
GPT models of 1.7B to 1T parameters on 32 to 3,072 A100s), and the one constant fitted to it.

Each row is priced at its published layout (tp, pp, dp = GPUs / (tp pp), full activation recompute,
1F1B or its interleaved form, fp16; what the paper leaves open, the micro-batch size, the number of
model chunks and how data-parallel state is held, is chosen as the best for that layout), with the
engine traits of Megatron-LM at the time (gpu_time.MEGATRON_2021), and compared with the published
TFLOP/s per GPU, which count the recompute (the paper's formula; shape.hardware_flops_per_token). The
planner's own best plan for the same model, GPUs and batch is searched alongside, and where its
layout differs the reason is the part of the step it shortens most.

``fit_max_efficiency`` is the fit: the GEMM efficiency model's ``max_efficiency`` (the one free
constant of the A100 preset; ``k_half`` is fixed) chosen so that the mean log error over the rows
is zero.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from compiler.planner.candidates import Constraints, dp_mode
from compiler.planner.gpu_cluster import GemmEfficiency, GpuCluster
from compiler.planner.gpu_search import GpuEstimate, search
from compiler.planner.gpu_time import MEGATRON_2021, EngineTraits
from compiler.planner.shape import DecoderShape

PUBLISHED_SCHEDULES = ("1f1b", "interleaved-1f1b")  # 1F1B is the interleaved schedule with one chunk


@dataclass(frozen=True)
class PublishedRun:
    params_billion: float
    shape: DecoderShape
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float  # published, counting the recompute

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class RowResult:
    run: PublishedRun
    published_layout: GpuEstimate | None  # None: infeasible in the memory model
    best: GpuEstimate | None
    reason: str  # why the best plan differs from the published layout ("" when it does not)

    @property
    def error(self) -> float | None:
        """Predicted over published TFLOP/s per GPU, minus one."""
        if self.published_layout is None:
            return None
        return self.published_layout.hardware_tflops_per_gpu / self.run.tflops_per_gpu - 1


def load_table(path: str | Path) -> tuple[list[PublishedRun], str]:
    """The rows of a published-table JSON (the megatron_sc21_table1.json layout) and its precision."""
    data = json.loads(Path(path).read_text())
    columns, setup = data["columns"], data["setup"]
    seq_len, vocab = int(setup["seq_len"]), int(setup["vocab"])
    precision = "fp16" if "fp16" in setup.get("precision", "fp16") else "bf16"
    runs = []
    for values in data["rows"]:
        row = dict(zip(columns, values))
        shape = DecoderShape.from_flags(layers=int(row["layers"]), d_model=int(row["hidden"]), heads=int(row["heads"]),
                                        seq_len=seq_len, vocab_size=vocab)
        runs.append(PublishedRun(row["params_billion"], shape, int(row["tp"]), int(row["pp"]), int(row["gpus"]),
                                 int(row["global_batch"]), float(row["tflops_per_gpu"])))
    return runs, precision


def price_published(run: PublishedRun, cluster: GpuCluster, *, precision: str,
                    traits: EngineTraits = MEGATRON_2021) -> GpuEstimate | None:
    layout = Constraints(dp=run.dp, pp=run.pp, mp=run.tp, activation_checkpointing=True, schedule=PUBLISHED_SCHEDULES)
    return search(run.shape, world=run.gpus, global_batch_size=run.global_batch, cluster=cluster, traits=traits,
                  precisions=(precision,), constraints=layout).best


def reproduce(runs: list[PublishedRun], cluster: GpuCluster, *, precision: str,
              traits: EngineTraits = MEGATRON_2021) -> list[RowResult]:
    out = []
    for run in runs:
        published = price_published(run, cluster, precision=precision, traits=traits)
        best = search(run.shape, world=run.gpus, global_batch_size=run.global_batch, cluster=cluster, traits=traits,
                      precisions=(precision,)).best
        out.append(RowResult(run, published, best, why_different(published, best)))
    return out


def why_different(published: GpuEstimate | None, best: GpuEstimate | None) -> str:
    """One line: what the best plan changes and the parts of the step it shortens most."""
    if best is None:
        return "no plan fits in memory"
    if published is None:
        return "the published layout does not fit this memory model; the best plan does"
    p, b = published.candidate, best.candidate
    changes = [f"{name} {new} instead of {old}" for name, old, new in (
        ("tp", p.mp, b.mp), ("pp", p.pp, b.pp), ("dp", p.dp, b.dp)) if old != new]
    if p.activation_checkpointing != b.activation_checkpointing:
        changes.append("no recompute" if not b.activation_checkpointing else "full recompute")
    if not changes:
        return ""
    gains = {part: getattr(published.breakdown, part) - getattr(best.breakdown, part)
             for part in ("compute", "bubble", "tp", "pp", "dp_exposed", "optimizer")}
    top = sorted((g, part) for part, g in gains.items() if g > 0)[::-1][:2]
    saved = ", ".join(f"{part} -{g:.2f} s" for g, part in top)
    return (f"{', '.join(changes)} ({dp_mode(b)}, micro-batch {b.micro_batch_size}, v {b.stages_per_rank}): "
            f"{saved} per step; {best.memory_bytes / 2**30:.0f} GiB per GPU")


def summary(results: list[RowResult]) -> dict:
    errors = [abs(r.error) for r in results if r.error is not None]
    return {"rows": len(results), "priced": len(errors), "max_abs_error": max(errors) if errors else None,
            "median_abs_error": statistics.median(errors) if errors else None}


def fit_max_efficiency(runs: list[PublishedRun], cluster: GpuCluster, *, precision: str,
                       traits: EngineTraits = MEGATRON_2021, k_half: float | None = None) -> float:
    """The ``max_efficiency`` whose predictions have zero mean log error over ``runs`` (bisection: the
    predictions rise with it)."""
    k = cluster.gemm.k_half if k_half is None else k_half
    lo, hi = 0.2, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        trial = replace(cluster, gemm=GemmEfficiency(mid, k))
        logs = [math.log(e.hardware_tflops_per_gpu / run.tflops_per_gpu)
                for run in runs if (e := price_published(run, trial, precision=precision, traits=traits))]
        if statistics.mean(logs) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
