"""How well the planner predicts measured runs: median absolute percentage error, Spearman's rank correlation,
whether the plan predicted fastest is within 10% of the measured fastest (``run.py validate``, runtime/lab/)."""

from __future__ import annotations

import statistics


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else 0.0


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["measured_s"]]
    ape = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in ok]
    best_predicted = min(ok, key=lambda r: r["predicted_s"], default=None)
    best_measured = min(ok, key=lambda r: r["measured_s"], default=None)
    return {
        "runs": len(rows), "measured": len(ok),
        "mdape": statistics.median(ape) if ape else None,
        "spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]) if len(ok) > 1 else None,
        "predicted_best": best_predicted and best_predicted["plan"],
        "measured_best": best_measured and best_measured["plan"],
        "predicted_best_within_10pct": bool(ok) and best_predicted["measured_s"] <= 1.10 * best_measured["measured_s"],
    }


def summary_line(name: str, r: dict) -> str:
    """One model's (or all models') figures; a rank correlation needs two measured runs, an error one (a small
    world can leave a model one plan, e.g. one ep plan on 2 ranks)."""
    mdape = "n/a" if r["mdape"] is None else f"{100 * r['mdape']:.1f}%"
    rho = "n/a" if r["spearman"] is None else f"{r['spearman']:.3f}"
    return (f"{name}: MdAPE {mdape}, Spearman {rho}, predicted best within 10% of measured best: "
            f"{r['predicted_best_within_10pct']} ({r['measured']} of {r['runs']} runs measured)")
