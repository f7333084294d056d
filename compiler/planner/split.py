"""A fast min-max split of a layer sequence into contiguous non-empty stages, for the GPU search's
hundreds of (stages, layers) pairs: compiler/partition.py's exact dynamic programme costs O(S L^2),
seconds per call at 126 layers. Here the largest stage cost is found by bisection over a greedy
packing (which, for a bound X, uses the fewest stages of cost <= X; Bokhari 1988), and stages are
split further until there are exactly ``n_stages``: the largest stage is the optimum to within 1e-9
of it, the split itself may differ from the engine's where several reach it.
"""

from __future__ import annotations


def _greedy(costs: list[float], limit: float) -> list[int]:
    """Items per stage, packing each stage as far as ``limit`` allows (an item above it gets a stage alone)."""
    sizes, total = [0], 0.0
    for c in costs:
        if sizes[-1] and total + c > limit:
            sizes.append(0)
            total = 0.0
        sizes[-1] += 1
        total += c
    return sizes


def min_max_split(costs: list[float], n_stages: int) -> list[int]:
    """Items per stage (each >= 1, ``n_stages`` of them) minimising the largest stage's summed cost."""
    if not 1 <= n_stages <= len(costs):
        raise ValueError(f"cannot split {len(costs)} items into {n_stages} non-empty stages")
    lo, hi = max(costs), sum(costs)
    if len(_greedy(costs, lo)) > n_stages:
        for _ in range(200):
            mid = (lo + hi) / 2
            if len(_greedy(costs, mid)) <= n_stages:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-12 * hi:
                break
    else:
        hi = lo
    sizes = _greedy(costs, hi)
    while len(sizes) < n_stages:  # more stages than the bound needs: split the stage with most items
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i:i + 1] = [sizes[i] // 2, sizes[i] - sizes[i] // 2]
    return sizes
