"""Split the sequence of transformer blocks into contiguous pipeline stages.

Pure functions, no torch: a pipeline runs at the pace of its slowest stage, so ``balanced_split``
minimises the largest stage cost exactly (dynamic programme over split points, O(S * L^2)), and
``layer_split`` applies it to the model's layers with the embedding and the LM head as layers too.
"""

from __future__ import annotations

from itertools import accumulate


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


def layer_split(costs: list[float], n_stages: int, *, memory: list[float] | None = None,
                memory_limit: float | None = None) -> list[int]:
    """Blocks per stage minimising the largest stage cost, for ``costs`` of [embedding, block 0, ...,
    block L-1, final norm + head] (and ``memory`` alike).

    The embedding and the head are layers of their own: stage 0 always holds the embedding and the
    last stage the head, but either may hold no block. A large-vocabulary head can cost several
    blocks, and then the best pipeline gives it a stage alone (blocks per stage [3, 3, 2, 0]).
    """
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
