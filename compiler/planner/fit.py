"""Fit the engine factors of the cost model to measured step times, on any device.

    measured ~ compute_scale * compute + comm_scale * communication + dp_comm_scale * dp
               + action_overhead * actions + optimizer + step_overhead

is linear in the five factors (compiler/planner/step.py ``StepTerms``), so they come from least squares.
Residuals are relative (each row divided by its measurement): a 0.1 s tiny step and a 10 s large one count
alike, which is what the planner's median percentage error and ranking need. The factors are physical
quantities (a time or a slowdown), so none may be negative: the exact non-negative least squares optimum is
found by solving every subset of the factors being fitted (at most 2^5 small systems) and keeping the best
feasible one. With few runs (a GPU lent for minutes: one or two runs) fit fewer factors (``factors``); the
others keep the cluster's values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from compiler.planner.cluster import FACTOR_NAMES, EngineFactors
from compiler.planner.step import StepTerms

FACTORS = FACTOR_NAMES


@dataclass(frozen=True)
class Fit:
    factors: dict[str, float]
    relative_errors: list[float]  # (predicted - measured) / measured per run


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


def fit_factors(terms: list[StepTerms], measured: list[float], *, factors: tuple[str, ...] = FACTORS,
                fixed: EngineFactors = EngineFactors()) -> Fit:
    """Non-negative ``factors`` minimising the sum of squared relative errors over the runs; the rest keep
    their values in ``fixed``."""
    if len(terms) != len(measured) or len(terms) < len(factors):
        raise ValueError(f"need at least {len(factors)} measured runs to fit {', '.join(factors)}, got {len(measured)}")
    unknown = [FACTORS.index(f) for f in factors]
    known = [i for i in range(len(FACTORS)) if i not in unknown]
    values = [getattr(fixed, name) for name in FACTORS]
    rows = [[x / y for x in t.row()] for t, y in zip(terms, measured)]
    # What the fixed factors and the (unfitted) optimizer term already explain is moved to the target.
    targets = [1 - (t.optimizer + sum(t.row()[i] * values[i] for i in known)) / y for t, y in zip(terms, measured)]
    best, best_loss = [0.0] * len(unknown), sum(y * y for y in targets)  # every fitted factor 0
    for k in range(1, len(unknown) + 1):
        for subset in itertools.combinations(range(len(unknown)), k):
            solution = _solve([[r[unknown[i]] for i in subset] for r in rows], targets)
            if solution is None or min(solution) < 0:
                continue
            x = [0.0] * len(unknown)
            for i, v in zip(subset, solution):
                x[i] = v
            loss = sum((sum(r[unknown[i]] * x[i] for i in range(len(unknown))) - y) ** 2 for r, y in zip(rows, targets))
            if loss < best_loss:
                best, best_loss = x, loss
    for i, v in zip(unknown, best):
        values[i] = v
    result = EngineFactors(*values)
    errors = [(t.combine(result) - y) / y for t, y in zip(terms, measured)]
    return Fit(dict(zip(FACTORS, values)), errors)
