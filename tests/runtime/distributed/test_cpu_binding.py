"""--bind-cores cost: which rank goes on which core (pure), and that binding a process really pins it."""

import itertools
import multiprocessing as mp
import os

import pytest

from compiler.partition import rank_costs
from runtime.distributed.cpu_binding import assign_cores, bind_process_to_core, rank_work
from runtime.distributed.mesh import GridLayout


def test_a_stage_as_heavy_as_the_rest_gets_a_core_of_its_own():
    # The split benchmark's auto split at pp=4: [emb + 2 blocks, 3 blocks, 3 blocks, head] in GFLOP.
    assert assign_cores([5.3, 7.95, 7.95, 25.77], [0, 1]) == [1, 1, 1, 0]
    # Uniform split: the head stage still gets its own core.
    assert assign_cores([5.3, 5.3, 5.3, 31.07], [0, 1]) == [1, 1, 1, 0]
    # As many cores as ranks: one rank per core.
    assert sorted(assign_cores([1.0, 3.0, 2.0], [4, 5, 6])) == [4, 5, 6]


@pytest.mark.parametrize("work", [[5, 4, 3, 3, 3], [1, 1, 1, 1], [9, 1, 1, 1, 1, 1, 1, 1], [2.5, 7, 3, 3, 4, 1]])
def test_packing_is_never_worse_than_4_3_of_the_best(work):
    # LPT's guarantee on identical machines (Graham 1969): max load <= (4/3 - 1/(3k)) x optimum, k cores.
    cores = [0, 1]
    placed = assign_cores(work, cores)
    load = lambda place: max(sum(w for w, c in zip(work, place) if c == core) for core in cores)
    best = min(load(p) for p in itertools.product(cores, repeat=len(work)))
    assert load(placed) <= (4 / 3 - 1 / 6) * best + 1e-9


@pytest.mark.parametrize("placement, expected", [
    # 4 stages on pp=2 (v=2). Looped: pp rank 0 holds stages 0 and 2, pp rank 1 stages 1 and 3.
    ("loop", [2.0, 2.0, 3.0, 3.0, 2.0, 2.0, 3.0, 3.0]),
    # V: pp rank 0 holds stages 0 and 3, pp rank 1 stages 1 and 2.
    ("v", [2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5]),
])
def test_rank_work_follows_the_stage_placement_and_mp_shards(placement, expected):
    layout = GridLayout(dp=2, pp=2, mp=2)
    coords = [layout.coordinates(r) for r in range(8)]
    # mp halves the work.
    work = rank_work(rank_costs([1.0, 2.0, 3.0, 4.0], placement, pp=2), coords, mp=2)
    assert work == expected


def _bound_cpus(core, queue):
    bind_process_to_core(core)
    queue.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_binding_pins_the_process_to_one_core():
    core = max(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_bound_cpus, args=(core, queue))
    proc.start()
    try:
        assert queue.get(timeout=60) == [core]
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
