"""Published runs (compiler/published/*.json, read by compiler/planner/published.py) priced by the cost model,
and the one constant fitted to them.

Each row is priced as the best plan within what its source states: what it leaves open is searched. Only
Megatron-LM's Table 1 (Narayanan et al. SC'21) is in-sample: the GEMM efficiency's ``max_efficiency`` was
fitted to it; every other file is out of sample. A row no plan matches says why (the search's reasons).

Metrics: ``hardware_tflops_per_gpu`` (Megatron's count with the recompute, shape.hardware_flops_per_token),
``model_tflops_per_gpu`` (PaLM's 6N + 12 L T d), ``megatron_tflops_per_gpu`` (Megatron-Core's count of
today: causal attention, 6N + 6 L T d, shape.megatron_model_flops_per_token), ``tokens_per_s_per_gpu`` and
``step_time_s``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from compiler.planner.cluster import Cluster, load_cluster
from compiler.planner.devices import GemmEfficiency
from compiler.planner.published import PublishedRun, PublishedTable
from compiler.planner.search import Estimate, SearchResult, search
from compiler.planner.shape import hardware_flops_per_token, megatron_model_flops_per_token


@dataclass(frozen=True)
class RowResult:
    table: PublishedTable
    run: PublishedRun
    priced: Estimate | None  # the best plan within the stated layout (fitting, else the fastest)
    why_unpriced: str = ""  # with no plan: the search's reasons

    @property
    def predicted(self) -> float | None:
        return None if self.priced is None else metric_value(self.table.metric, self.priced, self.run)

    @property
    def error(self) -> float | None:
        """Predicted over published, minus one (for step times: published over predicted, so that + is optimistic)."""
        if self.predicted is None:
            return None
        if self.table.metric == "step_time_s":
            return self.run.reported / self.predicted - 1
        return self.predicted / self.run.reported - 1

    @property
    def memory_error(self) -> float | None:
        if self.priced is None or self.run.memory_gib is None:
            return None
        return self.priced.memory_per_rank / 2**30 / self.run.memory_gib - 1


def metric_value(metric: str, e: Estimate, run: PublishedRun) -> float:
    tokens = e.tokens_per_sec
    if metric == "tokens_per_s_per_gpu":
        return tokens / run.gpus
    if metric == "step_time_s":
        return e.step_time
    if metric == "model_tflops_per_gpu":
        return e.model_tflops_per_gpu
    if metric == "megatron_tflops_per_gpu":
        return megatron_model_flops_per_token(run.shape) * tokens / run.gpus / 1e12
    if metric == "hardware_tflops_per_gpu":
        full = e.plan.ac == "full"
        return hardware_flops_per_token(run.shape, activation_checkpointing=full) * tokens / run.gpus / 1e12
    raise ValueError(f"unknown metric {metric}")


def _search(table: PublishedTable, run: PublishedRun, cluster: Cluster, **kw) -> SearchResult:
    traits = replace(table.engine, float8_linears=run.float8, ep_dispatch=run.dispatcher,
                     selective_policy=run.selective_policy or table.engine.selective_policy)
    return search(run.shape, world=run.gpus, global_batch_size=run.global_batch, cluster=cluster, traits=traits,
                  precisions=(table.precision,), constraints=traits.limits(run.layout), **kw)


def _priced(table: PublishedTable, run: PublishedRun, cluster: Cluster) -> tuple[Estimate | None, str]:
    """The best plan that fits, else the fastest; with none, the search's reasons."""
    fitting = _search(table, run, cluster)
    if fitting.best:
        return fitting.best, ""
    anything = _search(table, run, cluster, require_fit=False)
    return anything.best, "" if anything.best else anything.reasons()


def price_run(table: PublishedTable, run: PublishedRun, cluster: Cluster) -> Estimate | None:
    return _priced(table, run, cluster)[0]


def reproduce(table: PublishedTable, cluster: Cluster | None = None) -> list[RowResult]:
    cluster = cluster or load_cluster(table.cluster)
    return [RowResult(table, run, *_priced(table, run, cluster)) for run in table.runs]


def summary(results: list[RowResult]) -> dict:
    """Median and largest |error|, and how many rows are within 25%, over the rows priced."""
    errors = [abs(r.error) for r in results if r.error is not None]
    return {"rows": len(results), "priced": len(errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "within_25_percent": sum(e <= 0.25 for e in errors)}


def fit_max_efficiency(table: PublishedTable, cluster: Cluster, *, k_half: float | None = None) -> float:
    """The GEMM curve's ``max_efficiency`` whose predictions have zero mean log error over the table's rows
    (bisection: the predictions rise with it)."""
    k = cluster.device.gemm.k_half if k_half is None else k_half
    lo, hi = 0.2, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        trial = replace(cluster, device=replace(cluster.device, gemm=GemmEfficiency(mid, k)))
        logs = [math.log(1 + r.error) for r in reproduce(table, trial) if r.error is not None]
        if statistics.mean(logs) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
