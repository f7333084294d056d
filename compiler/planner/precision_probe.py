"""Is this the CPU the planner's calibration was measured on? If not, re-measure each precision.

A CPU cluster file records the identity of the CPU ``run.py calibrate`` measured
(``notes.cpu_identity``, compiler/planner/cpu_identity.py). ``check_calibration`` compares it with
this machine's. The same CPU: the calibration stands. Another CPU: each precision's speed may differ
by any factor (bf16 plans run several times slower on a CPU without AVX-512 BF16 than a calibration from one
with it predicts), so ``plan`` re-times calibration's compute-bound block benchmark in each
precision it plans for (one process, one thread, as calibration ran it: seconds in fp32, about 10 s
per precision without native support) and scales that precision's rate by now / calibrated. A file
without the benchmark's points cannot be rescaled: the planner then says it cannot predict here.
``--auto`` (every rank plans, and must agree without communicating) does not probe: on another CPU it
plans in fp32 only unless --precision is given, and says so.
"""

from __future__ import annotations

import torch

from compiler.planner.block_benchmark import SHAPES, block_seconds
from compiler.planner.cluster import Cluster
from compiler.planner.cpu_identity import cpu_identity, describe, identity_difference


def calibration_mismatch(cluster: Cluster, current: dict | None = None) -> str | None:
    """Why ``cluster``'s calibration is not of this CPU, or None when it is (or records no identity)."""
    recorded = cluster.notes.get("cpu_identity")
    if not recorded:
        return None
    difference = identity_difference(recorded, current or cpu_identity())
    return f"calibrated on {describe(recorded)}; this CPU: {describe(current or cpu_identity())} ({difference})" \
        if difference else None


def probe_precisions(cluster: Cluster, precisions: tuple[str, ...], *, repeats: int = 1) -> tuple[Cluster, str]:
    """``cluster`` with each precision's block rate (and matmul peak) scaled by its speed here now over
    calibration's, from the block benchmark calibration recorded; ValueError if it recorded none."""
    points = cluster.notes.get("block_points", {})
    missing = [p for p in precisions if p not in points]
    if missing:
        raise ValueError(f"the calibration records no block benchmark for {', '.join(missing)}; "
                         f"run `python run.py calibrate` on this machine")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # calibration ran one thread per process
    try:
        ratios = {}
        for precision in precisions:
            then_seconds, then_flops = points[precision][-1]  # the compute-bound shape, SHAPES[-1]
            seconds, flops = block_seconds(*SHAPES[-1], precision, repeats=repeats)
            ratios[precision] = (flops / seconds) / (then_flops / then_seconds)
    finally:
        torch.set_num_threads(threads)
    line = "re-measured each precision on this CPU: " + ", ".join(f"{p} x{r:.2f}" for p, r in ratios.items())
    return cluster.with_precision_rates(ratios, line), line


def check_calibration(cluster: Cluster, precisions: tuple[str, ...], *, probe: bool = True) -> tuple[Cluster, str | None]:
    """(the cluster to price with, a line to print or None). On another CPU: re-measured per precision
    (``probe``), else unchanged with the warning; ValueError when it cannot be re-measured."""
    mismatch = calibration_mismatch(cluster)
    if mismatch is None:
        return cluster, None
    if not probe:
        return cluster, f"warning: {mismatch}"
    try:
        probed, line = probe_precisions(cluster, precisions)
    except ValueError as e:
        raise ValueError(f"cannot predict on this CPU: {mismatch}; {e}") from None
    return probed, f"{mismatch}: {line}"
