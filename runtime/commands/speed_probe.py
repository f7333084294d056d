"""How fast this machine runs now, against the calibration the planner prices plans with.

A shared machine's speed drifts (other tenants, frequency scaling): plans priced with a calibration
taken on a busier day all come out too slow by about the same factor. Before planning for the local
machine, ``probe`` re-times what calibration timed (a transformer block's forward + backward at the
calibration's small and large shapes, fp32 and bf16, on one single-thread process per core at once)
and returns the geometric mean of now / then over those four points; compiler/planner/cluster.py's
``Cluster.rescaled`` applies it to every time-like rate of the cluster. Takes a few seconds.

Opt-in (``run.py plan --speed-probe``) because it does not do its job yet: on 2026-11-24 it measured the
machine 1.18x slower than calibrated (its four points ranged 0.92x-1.48x) while the engine ran 1.27x
faster than predicted, so ``plan --validate --world 4 --cluster cpu-2core`` erred 27.3% with it and 9.8%
without. Isolated block timings do not track what drifts (the engine factors fitted from whole runs);
a probe should re-run one of calibration's recorded engine runs instead.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from compiler.planner.cluster import Cluster
from runtime.commands.calibrate import SHAPES, block_seconds
from runtime.distributed.spawn import SpawnError, spawn_ranks

PRECISIONS_PROBED = ("fp32", "bf16")


def _probe_worker(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dist.barrier()  # every process measures at the same time, as calibration's did
    seconds = {p: [block_seconds(*shape, p, repeats=5)[0] for shape in SHAPES] for p in PRECISIONS_PROBED}
    Path(out_dir, f"probe{rank}.json").write_text(json.dumps(seconds))
    dist.destroy_process_group()


def probe(cluster: Cluster, *, timeout: float = 120) -> tuple[float, str] | None:
    """(now / calibrated time ratio, one-line description), or None when the cluster records no
    calibration points to compare with or the probe could not run."""
    then = cluster.notes.get("block_points", {})
    if not all(p in then for p in PRECISIONS_PROBED):
        return None
    processes = max(1, min(os.cpu_count() or 1, cluster.compute_units_per_node))
    with tempfile.TemporaryDirectory() as work:
        try:
            spawn_ranks(_probe_worker, world_size=processes, args=(work,), timeout=timeout)
        except SpawnError:
            return None
        runs = [json.loads(Path(work, f"probe{r}.json").read_text()) for r in range(processes)]
    ratios = [statistics.median(run[p][i] for run in runs) / then[p][i][0]
              for p in PRECISIONS_PROBED for i in range(len(SHAPES))]
    ratio = math.exp(statistics.mean(math.log(r) for r in ratios))
    detail = ", ".join(f"{p} {'small' if i == 0 else 'large'} {r:.2f}x"
                       for (p, i), r in zip([(p, i) for p in PRECISIONS_PROBED for i in range(len(SHAPES))], ratios))
    return ratio, f"speed probe: this machine now takes {ratio:.2f}x the calibrated time ({detail})"
