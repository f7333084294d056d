"""``python -m runtime.lab.fp8_benchmark``: a small Llama trained side by side in bf16 and with each FP8 recipe on
top of it (--fp8), the same data, seed and steps: the loss and validation loss they reach, and their step times.

What it answers: does training with FP8 products reach the loss bf16 reaches (the recipes' papers: within ~1% at
this scale)? Step times are recorded, not judged: on a CPU the recipes run torch's scaled GEMM where it takes
them (tensorwise, rowwise) and an exact float32 emulation otherwise (compiler/fp8/README.md), neither a fast
path. Each run is one process (``run.py`` under torchrun), one after another; results.json keeps every run's
figures and each recipe's loss relative to bf16's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compiler.fp8 import RECIPES
from runtime.atomic import write_json
from runtime.commands.launch import RunSpec, execute

# llama3-debug as it is (2 blocks of d 64, 4 heads / 2 kv, SwiGLU 192, T 64, 256 byte-level tokens) on the built-in
# text: 8 sequences a step.
MODEL = ["--model", "llama3-debug", "--micro-batch-size", "8", "--microbatches", "1", "--lr", "3e-3",
         "--warmup-steps", "30", "--data", "builtin", "--log-every", "50", "--eval-batches", "8"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.lab.fp8_benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="fp8_benchmark", help="folder for the runs and results.json")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="the high precision under FP8")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated FP8 recipes beside the plain run")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes.split(",") if r not in RECIPES]
    if unknown or args.steps < 1:
        p.error(f"--recipes: {', '.join(RECIPES)} (got {unknown}); --steps >= 1")
    return args


def specs(args: argparse.Namespace) -> list[RunSpec]:
    common = [*MODEL, "--precision", args.precision, "--steps", str(args.steps), "--eval-every", str(args.steps)]
    return [RunSpec(name=name or args.precision, nproc=1, args=[*common, *(["--fp8", name] if name else [])],
                    meta={"fp8": name}) for name in (None, *args.recipes.split(","))]


def tail_mean(losses: list[float], n: int = 20) -> float:
    """The mean of the last ``n`` training losses (one step's loss is one batch's: noisy)."""
    last = losses[-n:]
    return sum(last) / len(last)


def compare(results: list[dict]) -> dict:
    """Each run's final figures and, for FP8 runs, their ratio to the plain run's (the first)."""
    rows = {}
    for r in results:
        s = r["summary"] or {}
        rows[r["name"]] = {"fp8": r["meta"]["fp8"], "ok": r["ok"], "error": r["error"],
                           "final_val_loss": s.get("final_val_loss"), "train_loss_last20": tail_mean(s["losses"])
                           if s.get("losses") else None, "step_time_s": s.get("step_time_s"), "seconds": r["seconds"]}
    base = rows[results[0]["name"]]
    for row in rows.values():
        for key in ("final_val_loss", "train_loss_last20", "step_time_s"):
            row[f"{key}_vs_plain"] = (row[key] / base[key] if row[key] is not None and base[key] else None)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    results = []
    for spec in specs(args):
        result = execute(spec, out, timeout=args.timeout)
        results.append({"name": spec.name, "meta": spec.meta, "ok": result.ok, "error": result.error,
                        "seconds": result.seconds, "summary": result.summary})
        print(f"{spec.name}: " + (f"val loss {result.summary['final_val_loss']:.4f}, step "
                                  f"{result.summary['step_time_s'] * 1e3:.1f} ms" if result.ok else result.error),
              flush=True)
    rows = compare(results)
    write_json(out / "results.json", {"steps": args.steps, "precision": args.precision, "flags": MODEL, "runs": rows})
    print(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
