"""Fit the engine factors of the time model to measured step times.

    measured ~ compute_scale * compute + comm_scale * communication + dp_comm_scale * fsdp
               + action_overhead * actions + optimizer + step_overhead

is linear in the five factors, so they come from least squares. Residuals are relative
(each row divided by its measurement): a 0.1 s tiny step and a 10 s large one count alike, which is
what the planner's median percentage error and ranking need. The factors are physical quantities
(a time or a slowdown), so none may be negative: the exact non-negative least squares optimum is
found by solving every subset of factors (at most 2^5 small systems) and keeping the best feasible one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from compiler.planner.time_model import StepTerms

FACTORS = ("compute_scale", "comm_scale", "dp_comm_scale", "action_overhead", "step_overhead")


@dataclass(frozen=True)
class Fit:
    factors: dict[str, float]
    relative_errors: list[float]  # (predicted - measured) / measured per calibration run


def _row(t: StepTerms) -> list[float]:
    return [t.compute, t.communication, t.fsdp, t.actions, 1.0]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Least squares via the normal equations (a few unknowns), Gaussian elimination with pivoting."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_factors(terms: list[StepTerms], measured: list[float]) -> Fit:
    """Non-negative factors minimising the sum of squared relative errors over the runs."""
    if len(terms) != len(measured) or len(terms) < len(FACTORS):
        raise ValueError(f"need at least {len(FACTORS)} measured runs, got {len(measured)}")
    rows = [[x / y for x in _row(t)] for t, y in zip(terms, measured)]
    targets = [1 - t.optimizer / y for t, y in zip(terms, measured)]  # the optimizer term is not fitted
    best, best_loss = [0.0] * len(FACTORS), sum(y * y for y in targets)  # all factors 0
    for k in range(1, len(FACTORS) + 1):
        for subset in itertools.combinations(range(len(FACTORS)), k):
            solution = _solve([[r[i] for i in subset] for r in rows], targets)
            if solution is None or min(solution) < 0:
                continue
            x = [0.0] * len(FACTORS)
            for i, v in zip(subset, solution):
                x[i] = v
            loss = sum((sum(a * b for a, b in zip(r, x)) - y) ** 2 for r, y in zip(rows, targets))
            if loss < best_loss:
                best, best_loss = x, loss
    factors = dict(zip(FACTORS, best))
    errors = [(sum(a * b for a, b in zip(_row(t), best)) + t.optimizer - y) / y for t, y in zip(terms, measured)]
    return Fit(factors, errors)
