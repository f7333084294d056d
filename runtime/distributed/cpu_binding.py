"""More ranks than CPU cores: put each rank on a core chosen by its share of the pipeline's work.

On a GPU node every rank owns a device. On a CPU node with fewer cores than ranks (4 or 8 simulated
ranks on 2 cores here) the OS time-shares the cores, so while a heavy stage computes, the light stages'
work competes with it for the same cores and the pipeline no longer runs at the pace of its busiest
stage: a better stage split then gains less than its costs predict. ``--bind-cores cost`` packs the
node's ranks onto its cores by estimated work, longest first (LPT: each rank, heaviest first, takes the
core with the least work so far), so a stage as heavy as the others together gets a core of its own.

Off by default: ranks that must progress together (a TP group's all-reduces, an FSDP group's
collectives) gain nothing from sharing a core, and the OS's own balancing is the safer choice there.
"""

from __future__ import annotations

import os
from typing import Sequence


def rank_work(pp_rank_costs: Sequence[float], coordinates: Sequence[tuple[int, int, int]], *, mp: int) -> list[float]:
    """Estimated work of each rank: the summed cost of its pp rank's stages (``pp_rank_costs``, by the
    schedule's placement) split over its ``mp`` tensor-parallel shards. ``coordinates[i]`` is rank i's
    (dp, pp, mp) position."""
    return [pp_rank_costs[pp_rank] / mp for _, pp_rank, _ in coordinates]


def assign_cores(work: Sequence[float], cores: Sequence[int]) -> list[int]:
    """Longest-processing-time packing: ranks in decreasing work each take the least-loaded core (ties:
    the lower rank, the earlier core). Returns the core of every rank."""
    load = [0.0] * len(cores)
    placed = [0] * len(work)
    for rank in sorted(range(len(work)), key=lambda r: (-work[r], r)):
        slot = min(range(len(cores)), key=lambda i: (load[i], i))
        placed[rank] = cores[slot]
        load[slot] += work[rank]
    return placed


def bind_process_to_core(core: int) -> None:
    """Every thread of this process (gloo's workers included) onto ``core``; threads started later
    inherit it from the main thread."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile


def bind_node_ranks(pp_rank_costs: Sequence[float], coordinates: Sequence[tuple[int, int, int]], *, mp: int,
                    rank: int, local_rank: int, local_world_size: int) -> dict[int, int] | None:
    """Bind this rank to its core among this node's ranks (torchrun numbers a node's ranks
    contiguously). Every rank computes the same packing. Returns {global rank: core} for the node, or
    None where the OS cannot bind (not Linux)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    first = rank - local_rank
    node = list(range(first, first + local_world_size))
    work = rank_work(pp_rank_costs, [coordinates[r] for r in node], mp=mp)
    cores = assign_cores(work, sorted(os.sched_getaffinity(0)))
    bind_process_to_core(cores[local_rank])
    return dict(zip(node, cores))
