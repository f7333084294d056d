"""Split the sequence of transformer blocks into contiguous pipeline stages.

Pure functions, no torch: a pipeline runs at the pace of its slowest stage, so ``balanced_split``
minimises the largest stage cost exactly (dynamic programme over split points, O(S * L^2)), and
``layer_split`` applies it to the model's layers with the embedding and the LM head as layers too.

In a V placement (ZBV, DualPipeV) rank r runs stages r and 2p-1-r, so a rank's pace is the *sum* of
its pair: ``v_balanced_split`` minimises the busiest rank's pair exactly, peeling pairs from both ends
of the layer sequence (O(p * L^4 / 24)). Rank 0 then holds the embedding and the head, and a heavy
head is best paired with a light first stage.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable


def balanced_split(costs: list[float], n_stages: int, *, memory: list[float] | None = None,
                   memory_limit: float | None = None) -> list[int]:
    """Blocks per stage (each >= 1, summing to len(costs)) minimising the maximum stage cost.

    With ``memory`` (per block) and ``memory_limit``, only splits whose every stage fits are allowed;
    ValueError if none does. Ties are broken towards earlier split points, so the result is deterministic.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {n_stages} non-empty stages")
    prefix = [0.0, *accumulate(costs)]
    mem_prefix = [0.0, *accumulate(memory)] if memory is not None else None

    def fits(j: int, i: int) -> bool:
        return mem_prefix is None or memory_limit is None or mem_prefix[i] - mem_prefix[j] <= memory_limit

    inf = float("inf")
    # best[s][i]: minimal max-stage cost of putting blocks [0, i) on s stages; cut[s][i]: start of the last stage.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                if mem_prefix is None and best[s - 1][j] >= best[s][i]:
                    break  # best[s - 1][j] never falls as j grows (costs >= 0): no later cut is better
                if not fits(j, i):
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[n_stages][n] == inf:
        raise ValueError(f"no split of {n} blocks into {n_stages} stages keeps every stage within {memory_limit:.3g}")
    sizes, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def v_balanced_split(costs: list[float], pp: int) -> list[int]:
    """Items per stage for 2 * ``pp`` stages in a V placement (rank r holds stages r and 2pp-1-r), each
    stage non-empty, minimising the largest per-rank sum; among the splits that reach it, the one with
    the smallest largest stage (a pipeline fills and drains at its stages' pace: on 2 ranks with ZBV,
    blocks [2, 2, 2, 2] ran 1.84x the naive loop and the equally rank-balanced [0, 2, 2, 4] 1.65x).
    Ties go to earlier cut points.
    """
    n = len(costs)
    if pp < 1 or n < 2 * pp:
        raise ValueError(f"cannot split {n} blocks into {2 * pp} non-empty stages")
    prefix = [0.0, *accumulate(costs)]
    busiest_rank = _v_search(prefix, pp, pair=lambda a, b: a + b, limit=float("inf"))[0]
    # Float sums of the same costs in another order may differ in the last bits.
    return _v_search(prefix, pp, pair=max, limit=busiest_rank * (1 + 1e-12))[1]


def _v_search(prefix: list[float], pp: int, *, pair: Callable[[float, float], float],
              limit: float) -> tuple[float, list[int]]:
    """Exact min over V splits of the largest ``pair(front stage, back stage)`` over ranks, every rank's
    two stages together within ``limit``; returns (that minimum, items per stage).

    State (k, i, j): ranks 0..k-1 took items [0, i) and [j, n); rank k takes [i, a) as stage k and
    [b, j) as stage 2pp-1-k. The innermost rank's two stages are adjacent: it takes the rest [i, j).
    Both objectives grow with a segment's length (costs are non-negative), which bounds the loops.
    """
    n = len(prefix) - 1
    inf = float("inf")

    def cost(a: int, b: int) -> float:
        return prefix[b] - prefix[a]

    def innermost(i: int, j: int) -> tuple[float, int | None]:
        if cost(i, j) > limit:
            return inf, None
        return min((pair(cost(i, c), cost(c, j)), c) for c in range(i + 1, j))

    best = {(i, j): innermost(i, j) for i in range(n) for j in range(i + 2, n + 1)}
    choices = []
    for k in range(pp - 2, -1, -1):
        inner = 2 * (pp - 1 - k)  # stages the ranks inside this one still need
        layer = {}
        for i in range(k, n):
            for j in range(i + inner + 2, n - k + 1):
                value, choice = inf, None
                for a in range(i + 1, j - inner):
                    front = cost(i, a)
                    if front > limit or pair(front, 0.0) >= value:
                        break
                    for b in range(j - 1, a + inner - 1, -1):
                        back = cost(b, j)
                        mine = pair(front, back)
                        if front + back > limit or mine >= value:
                            break
                        candidate = max(mine, best[(a, b)][0])
                        if candidate < value:
                            value, choice = candidate, (a, b)
                layer[(i, j)] = (value, choice)
        choices.append(layer)
        best = layer
    if best[(0, n)][0] == inf:
        raise ValueError("no V split within the limit")
    fronts, backs, i, j = [], [], 0, n
    for layer in reversed(choices):  # rank 0 first
        a, b = layer[(i, j)][1]
        fronts.append(a - i)
        backs.append(j - b)
        i, j = a, b
    value, middle = best[(0, n)][0], innermost(i, j)[1]
    return value, [*fronts, middle - i, j - middle, *backs[::-1]]


PLACEMENTS = ("loop", "v")


def placement_stages(placement: str, pp_rank: int, *, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pp rank ``pp_rank`` holds. "loop" (Narayanan et al. 2021): r, r + p, r + 2p, ...;
    "v" (Qi et al. 2024, ZB-V): r and 2p-1-r, so the first and the last stage share rank 0."""
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"a V placement holds 2 stages per rank, got {stages_per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def rank_costs(stage_costs: list[float], placement: str, *, pp: int) -> list[float]:
    """Per pp rank, the summed cost of the stages it holds."""
    v = len(stage_costs) // pp
    return [sum(stage_costs[s] for s in placement_stages(placement, r, pp=pp, stages_per_rank=v)) for r in range(pp)]


def layer_split(costs: list[float], n_stages: int, *, placement: str = "loop", memory: list[float] | None = None,
                memory_limit: float | None = None) -> list[int]:
    """Blocks per stage minimising the largest stage cost (the largest rank's pair of stages for a "v"
    placement), for ``costs`` of [embedding, block 0, ..., block L-1, final norm + head] (and ``memory`` alike).

    The embedding and the head are layers of their own: stage 0 always holds the embedding and the
    last stage the head, but either may hold no block. A large-vocabulary head can cost several
    blocks, and then the best pipeline gives it a stage alone (blocks per stage [3, 3, 2, 0]).
    """
    if placement == "v":
        if memory is not None:
            raise ValueError("a memory limit is not supported for a V placement's split")
        items = v_balanced_split(costs, n_stages // 2)
    else:
        items = balanced_split(costs, n_stages, memory=memory, memory_limit=memory_limit)
    blocks = list(items)
    blocks[0] -= 1  # the embedding
    blocks[-1] -= 1  # the head (the same stage when n_stages == 1)
    return blocks


def stage_costs_with_ends(costs: list[float], blocks_per_stage: list[int]) -> list[float]:
    """Per-stage cost for ``costs`` of [embedding, blocks..., head]: the ends go to the first and last stage."""
    items = list(blocks_per_stage)
    items[0] += 1
    items[-1] += 1
    return stage_costs(costs, items)


def uniform_split(n_layers: int, n_stages: int) -> list[int]:
    """Equal blocks per stage; a remainder goes to the earliest stages."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def stage_costs(costs: list[float], sizes: list[int]) -> list[float]:
    bounds = [0, *accumulate(sizes)]
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def parse_split(spec: str, *, n_stages: int, n_layers: int) -> list[int] | None:
    """Parse ``--split``: None for auto, else blocks per stage. Raises ValueError naming the flag."""
    if spec == "auto":
        return None
    if spec == "uniform":
        return uniform_split(n_layers, n_stages)
    if spec.startswith("manual:"):
        try:
            sizes = [int(x) for x in spec[len("manual:"):].split(",")]
        except ValueError:
            sizes = []
        # The first stage may hold only the embedding and the last only the head; middle stages need a block.
        if len(sizes) != n_stages or min(sizes[1:-1], default=1) < 1 or min(sizes, default=-1) < 0 \
                or sum(sizes) != n_layers:
            raise ValueError(
                f"--split {spec} must list {n_stages} block counts (pp x stages-per-rank) summing to {n_layers} "
                f"layers, each >= 1 except the first and last (>= 0), e.g. "
                f"manual:{','.join(map(str, uniform_split(n_layers, n_stages)))}"
            )
        return sizes
    raise ValueError(f"--split must be auto, uniform or manual:N0,N1,..., got {spec!r}")


def split_points(sizes: list[int]) -> list[int]:
    """Index of the first block of every stage after the first (len(blocks) when the last stage holds
    only the head)."""
    return list(accumulate(sizes))[:-1]
