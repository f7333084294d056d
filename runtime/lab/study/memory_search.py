"""The largest micro-batch that fits a memory budget: doubling, then bisection.

``fits(b)`` runs a real training job at micro-batch size b and says whether it stayed within the
budget (CUDA: no out-of-memory error and peak allocated <= budget; CPU: measured peak tensor
memory <= budget, see runtime/memory.py). Memory grows monotonically with the batch, so the boundary is found with
O(log b) trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SearchResult:
    max_fitting: int  # 0 when even a micro-batch of 1 does not fit
    first_failing: int | None  # None when the cap was reached without failing
    trials: list[tuple[int, bool]] = field(default_factory=list)


def search_max_batch(fits: Callable[[int], bool], *, start: int = 1, cap: int = 4096,
                     resolution: float = 0.0) -> SearchResult:
    """Double from ``start`` until a trial fails (or ``cap``), then bisect until
    fail - fit <= max(1, resolution * fit). If ``start`` already fails, bisect below it."""
    trials: list[tuple[int, bool]] = []

    def trial(b: int) -> bool:
        ok = fits(b)
        trials.append((b, ok))
        return ok

    good, bad = (start, None) if trial(start) else (0, start)
    while bad is None and good < cap:
        candidate = min(cap, good * 2)
        if trial(candidate):
            good = candidate
        else:
            bad = candidate
    if bad is None:
        return SearchResult(good, None, trials)
    while bad - good > max(1, int(resolution * good)):
        middle = (good + bad) // 2
        if trial(middle):
            good = middle
        else:
            bad = middle
    return SearchResult(good, bad, trials)
