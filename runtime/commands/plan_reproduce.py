"""``run.py plan --reproduce [FILE ...]``: published runs (compiler/published/*.json) priced at the layouts they
state, each row's error, which rows a constant was fitted to (in-sample) and the errors in and out of sample
apart (compiler/planner/published.py reads the files, compiler/planner/reproduce.py prices them); ``--fit``
refits the GEMM efficiency constant to the in-sample tables."""

from __future__ import annotations

import argparse
import json
import time

from compiler.planner.cluster import load_cluster
from compiler.planner.published import load_table, published_files
from compiler.planner.reproduce import RowResult, fit_max_efficiency, reproduce, summary


def row_line(r: RowResult) -> str:
    run, e = r.run, r.priced
    predicted = "-" if r.predicted is None else f"{r.predicted:,.1f}"
    error = "-" if r.error is None else f"{100 * r.error:+.1f}%"
    memory = ""
    if r.memory_error is not None:
        memory = f", memory {e.memory_per_rank / 2**30:.1f} vs {run.memory_gib} GiB ({100 * r.memory_error:+.0f}%)"
    plan = e.plan.describe() + ("" if e.fits else " (does not fit)") if e else f"no plan: {r.why_unpriced}"
    unmodelled = f"  [not modelled: {', '.join(run.unmodelled)}]" if run.unmodelled else ""
    return (f"| {run.label} | {run.reported:,.1f} | {predicted} | {error}{memory} | "
            f"{'in' if r.table.fitted else 'out of'} sample | {plan}{unmodelled} |")


def print_summary(name: str, results: list[RowResult]) -> dict:
    s = summary(results)
    unpriced = f" ({s['rows'] - s['priced']} not priced: no plan)" if s["rows"] > s["priced"] else ""
    if s["priced"]:
        print(f"{name}: {s['priced']} rows{unpriced}, median |error| {100 * s['median_abs_error']:.1f}%, largest "
              f"{100 * s['max_abs_error']:.1f}%, {s['within_25_percent']} within 25%")
    elif s["rows"]:
        print(f"{name}: {s['rows']} rows, none priced")
    return s


def print_reproduction(args: argparse.Namespace) -> int:
    files = args.reproduce or [str(p) for p in published_files()]
    tables = [load_table(f) for f in files]
    if args.fit:
        fitted = [t for t in tables if t.fitted]
        if not fitted:
            raise ValueError("--fit refits to in-sample tables (\"fitted\": true); none was given")
        for t in fitted:
            cluster = load_cluster(args.cluster or t.cluster)
            start = time.perf_counter()
            value = fit_max_efficiency(t, cluster)
            print(f"{t.name}: fitted gemm.max_efficiency = {value:.4f} (k_half {cluster.device.gemm.k_half:g}; "
                  f"{cluster.name} has {cluster.device.gemm.max_efficiency:.4f}) in {time.perf_counter() - start:.0f} s")
    every: list[RowResult] = []
    for table in tables:
        cluster = load_cluster(args.cluster or table.cluster)
        start = time.perf_counter()
        results = reproduce(table, cluster)
        every += results
        print(f"\n{table.name} on {cluster.name} ({table.engine.name}, {table.precision}, {table.metric}; "
              f"{'in sample: a constant was fitted to these rows' if table.fitted else 'out of sample'}), "
              f"priced in {time.perf_counter() - start:.0f} s\n{table.source}")
        print("| run | published | predicted | error | sample | priced plan |\n| --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(row_line(r))
    print()
    out = {"in_sample": print_summary("in sample", [r for r in every if r.table.fitted]),
           "out_of_sample": print_summary("out of sample", [r for r in every if not r.table.fitted]),
           "out_of_sample_modelled": print_summary("out of sample, every feature modelled",
                                                   [r for r in every if not r.table.fitted and not r.run.unmodelled])}
    if args.json:
        rows = [{"table": r.table.name, "run": r.run.label, "fitted": r.table.fitted, "metric": r.table.metric,
                 "published": r.run.reported, "predicted": r.predicted, "error": r.error,
                 "memory_gib_published": r.run.memory_gib, "memory_error": r.memory_error,
                 "unmodelled": list(r.run.unmodelled), "plan": r.priced.to_json() if r.priced else None,
                 "why_unpriced": r.why_unpriced or None} for r in every]
        with open(args.json, "w") as f:
            json.dump({"summary": out, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0
