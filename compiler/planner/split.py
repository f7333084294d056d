"""Which layers each pipeline rank holds: the engine's own split (compiler/partition.py, placement-aware).

The engine splits [embedding, block 0, ..., block L-1, norm + head] into pp x v stages by an exact
min-max over counted FLOPs (``--split auto``): looped placements balance the busiest stage, V placements
(zbv, dualpipev: rank r holds stages r and 2p-1-r) the busiest rank's pair. The planner prices that split.
The looped programme is fast at any depth; the V programme is O(p L^4) and takes seconds beyond ~60
layers, so above ``EXACT_V_ITEMS`` the planner finds the same busiest-pair cost by bisection over a
feasibility check (``v_split``) whose stage boundaries may differ from the engine's where several splits
reach it (the engine then breaks ties by the shortest longest stage).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

from compiler.partition import layer_split
from compiler.schedules import SCHEDULES

EXACT_V_ITEMS = 48


def _v_sizes(costs: list[float], pp: int, limit: float) -> list[int] | None:
    """Items per stage of a V split whose every rank's pair costs at most ``limit`` (greedy from the outer ranks
    inwards, each taking the front / back pair that covers the most items), or None if it finds none."""
    prefix = [0.0, *accumulate(costs)]
    i, j, fronts, backs = 0, len(costs), [], []
    for k in range(pp - 1):
        inner = 2 * (pp - 1 - k)  # items the inner ranks need at least
        best, b = None, i + 1 + inner
        for a in range(i + 1, j - inner):
            front = prefix[a] - prefix[i]
            if front > limit:
                break
            b = max(b, a + inner)  # the least back start this front allows grows with the front
            while b < j and prefix[j] - prefix[b] + front > limit:
                b += 1
            if b >= j:
                break
            if best is None or (a - i) + (j - b) >= best[0]:
                best = ((a - i) + (j - b), a, b)
        if best is None:
            return None
        _, a, b = best
        fronts.append(a - i)
        backs.append(j - b)
        i, j = a, b
    if j - i < 2 or prefix[j] - prefix[i] > limit:
        return None
    middle = min(range(i + 1, j), key=lambda c: max(prefix[c] - prefix[i], prefix[j] - prefix[c]))
    return [*fronts, middle - i, j - middle, *backs[::-1]]


def _pair_costs(costs: list[float], sizes: list[int]) -> list[float]:
    bounds = [0, *accumulate(sizes)]
    stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    p = len(sizes) // 2
    return [stages[r] + stages[2 * p - 1 - r] for r in range(p)]


def _improve(costs: list[float], sizes: list[int]) -> list[int]:
    """Move one item across a stage boundary while that lowers (busiest pair, its multiplicity)."""
    def score(x):
        pairs = _pair_costs(costs, x)
        top = max(pairs)
        return top, sum(1 for c in pairs if c >= top * (1 - 1e-12))

    best = score(sizes)
    improved = True
    while improved:
        improved = False
        for s in range(len(sizes) - 1):
            for step in (1, -1):  # an item from stage s + 1 to s, or from s to s + 1
                trial = list(sizes)
                trial[s] += step
                trial[s + 1] -= step
                if min(trial) < 1:
                    continue
                value = score(trial)
                if value < best:
                    sizes, best, improved = trial, value, True
    return sizes


def v_split(costs: list[float], pp: int) -> list[int]:
    """Items per stage for 2 ``pp`` V stages, minimising the busiest rank's pair: bisection on its cost over the
    greedy packing, then single-item moves across stage boundaries while they help."""
    lo, hi = max(sum(costs) / pp, max(costs)), sum(costs)
    sizes = _v_sizes(costs, pp, hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        trial = _v_sizes(costs, pp, mid)
        if trial is None:
            lo = mid
        else:
            hi, sizes = mid, trial
        if hi - lo <= 1e-9 * hi:
            break
    return _improve(costs, sizes)


def blocks_per_stage(costs: tuple[float, ...], n_stages: int, placement: str) -> list[int]:
    """The engine's split of [embedding, blocks..., head] (``compiler.partition.layer_split``)."""
    if placement == "v" and len(costs) > EXACT_V_ITEMS:
        items = v_split(list(costs), n_stages // 2)
        return [items[0] - 1, *items[1:-1], items[-1] - 1]
    return layer_split(list(costs), n_stages, placement=placement)


@dataclass(frozen=True)
class Holding:
    """What one pp rank holds across its v stages."""
    kinds: tuple[tuple[str, int], ...]  # (block kind, count), sorted
    embedding: bool
    head: bool

    @property
    def blocks(self) -> int:
        return sum(n for _, n in self.kinds)

    def count(self, kind: str) -> int:
        return dict(self.kinds).get(kind, 0)


def rank_holdings(kinds: list[str], sizes: list[int], schedule: str, pp: int, v: int) -> list[Holding]:
    """Per pp rank: its blocks by kind and whether it holds the embedding and / or the head."""
    starts = [0, *accumulate(sizes)]
    spec = SCHEDULES[schedule]
    out = []
    for r in range(pp):
        held = spec.stage_indices(r, pp=pp, stages_per_rank=v)
        count = Counter(k for s in held for k in kinds[starts[s]:starts[s + 1]])
        out.append(Holding(tuple(sorted(count.items())), 0 in held, len(sizes) - 1 in held))
    return out
