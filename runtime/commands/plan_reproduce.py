"""``run.py plan --reproduce FILE``: a published table of large-scale runs (Narayanan et al. SC'21 Table 1,
compiler/published/megatron_sc21_table1.json) priced at each row's published layout, beside the
planner's own best plan for the same model, GPUs and batch (compiler/planner/reproduce.py);
``--fit`` refits the GEMM efficiency constant to it."""

from __future__ import annotations

import argparse
import json
import time

from compiler.planner.cluster import load_cluster
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.reproduce import fit_max_efficiency, load_table, reproduce, summary

DEFAULT_CLUSTER = "a100-80gb"  # Table 1 ran on DGX A100 80GB nodes (Selene)


def markdown_table(results) -> str:
    lines = ["| model | GPUs | published layout (tp x pp x dp) | published TFLOP/s/GPU | predicted | error "
             "| planner's best plan | its speed-up | why it differs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        run, p, b = r.run, r.published_layout, r.best
        predicted = f"{p.hardware_tflops_per_gpu:.1f}" if p else "does not fit"
        error = f"{100 * r.error:+.1f}%" if r.error is not None else "-"
        best = b.candidate.describe() if b else "none fits"
        speedup = f"{p.step_time / b.step_time:.2f}x" if p and b else "-"
        lines.append(f"| {run.params_billion}B | {run.gpus} | {run.tp} x {run.pp} x {run.dp} | "
                     f"{run.tflops_per_gpu:.0f} | {predicted} | {error} | {best} | {speedup} | "
                     f"{r.reason or 'same layout'} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster or DEFAULT_CLUSTER)
    if not isinstance(cluster, GpuCluster):
        raise ValueError(f"--reproduce needs a GPU cluster, got {args.cluster}")
    runs, precision = load_table(args.reproduce)
    if args.fit:
        start = time.perf_counter()
        value = fit_max_efficiency(runs, cluster, precision=precision)
        print(f"fitted gemm.max_efficiency = {value:.4f} (k_half {cluster.gemm.k_half:g}; {cluster.name} has "
              f"{cluster.gemm.max_efficiency:.4f}) in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    results = reproduce(runs, cluster, precision=precision)
    print(f"{args.reproduce} on {cluster.name} ({precision}), priced in {time.perf_counter() - start:.0f} s:")
    print(markdown_table(results))
    s = summary(results)
    print(f"predicted vs published TFLOP/s per GPU: median |error| {100 * s['median_abs_error']:.1f}%, "
          f"largest {100 * s['max_abs_error']:.1f}% ({s['priced']} of {s['rows']} rows priced)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": cluster.name, "summary": s, "rows": [
                {"params_billion": r.run.params_billion, "gpus": r.run.gpus, "published_tflops_per_gpu": r.run.tflops_per_gpu,
                 "published_layout": r.published_layout.to_json() if r.published_layout else None,
                 "best": r.best.to_json() if r.best else None, "why_different": r.reason} for r in results]}, f, indent=2)
        print(f"wrote {args.json}")
    return 0
