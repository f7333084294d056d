"""The engine's T limit within 20 GiB on 8 ranks for model shapes side by side (issue 55): ``python -m
runtime.lab.long_context_limit``.

For each model shape of runtime/lab/study/long_context.py (``MODEL_SHAPES``: the 4 x d 256 Llama and gpt-oss at the
same layers, width and heads) and cp 1, 2, 4 and 8 at dp 8 / cp, the longest T the memory model predicts within
20 GiB of machine memory (the preflight's sum over the node's ranks), without checkpointing and with selective
checkpointing (``longest_sequence``). ``--check MODEL:CP:T`` also trains one cp group (cp ranks, dp 1) one step at
T with the memory model's prediction of its peak tensor bytes beside the measured one (the busiest rank's, torch's
profiler) and the process peak (``--compact-cpu-memory``: resident memory follows live tensors), as the study's
limit checks run. Prints markdown tables; ``--out`` also keeps each check's logs and a results.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from models import spec_of
from runtime.commands.flags import parse_train_config
from runtime.commands.launch import execute
from runtime.lab.study.long_context import (
    BUDGET_GIB,
    COMMON,
    CP_DEGREES,
    MODEL_SHAPES,
    RANKS,
    SELECTIVE,
    check_spec,
    longest_sequence,
)

AC_FLAGS = {"none": [], "selective": SELECTIVE}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.lab.long_context_limit", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODEL_SHAPES), help=f"comma-separated subset of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--check", nargs="*", default=[], metavar="MODEL:CP:T",
                   help="one-step runs of one cp group (dp 1) checking the memory model, e.g. gpt-oss-debug:2:16384")
    p.add_argument("--check-ac", choices=tuple(AC_FLAGS), default="selective", help="the check runs' checkpointing")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each check run may take")
    p.add_argument("--out", help="folder for the check runs' logs and results.json (default: a temporary one)")
    return p


def parse_check(text: str) -> tuple[str, int, int]:
    """``MODEL:CP:T`` -> (model, cp, T); T a multiple of 2 cp (each rank holds two load-balanced chunks)."""
    try:
        model, cp, seq_len = text.split(":")
        cp, seq_len = int(cp), int(seq_len)
    except ValueError:
        raise ValueError(f"--check {text!r}: expected MODEL:CP:T, e.g. gpt-oss-debug:2:16384") from None
    if model not in MODEL_SHAPES:
        raise ValueError(f"--check {text!r}: the model must be one of {', '.join(MODEL_SHAPES)}")
    if cp not in CP_DEGREES or seq_len <= 0 or seq_len % (2 * cp):
        raise ValueError(f"--check {text!r}: cp must be one of {CP_DEGREES} and T a positive multiple of 2 cp")
    return model, cp, seq_len


def parameter_count(shape: list[str]) -> int:
    """The parameters of the model ``shape`` names (tied matrices once), built on the meta device."""
    cfg = parse_train_config([*shape, *COMMON], world_size=1).model
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg)
    return sum(p.numel() for p in model.parameters())


def limit_rows(shape: list[str]) -> list[dict]:
    """Per cp: the longest T predicted within the budget without and with selective checkpointing."""
    return [{"cp": cp, "none": longest_sequence(cp, shape=shape), "selective": longest_sequence(cp, SELECTIVE, shape=shape)}
            for cp in CP_DEGREES]


def check_row(result: dict) -> dict:
    s = result["summary"]
    peak = s.get("peak_bytes")
    return {"model": result["model"], "cp": result["cp"], "seq_len": result["seq_len"], "ac": result["ac"],
            "ok": result["ok"], "peak_tensor_bytes": s.get("peak_tensor_bytes"),
            "predicted_peak_tensor_bytes": s.get("predicted_peak_tensor_bytes"), "process_peak_bytes": peak,
            "node_bytes": RANKS * peak if peak else None, "step_time_s": (s.get("step_times") or [None])[-1],
            "command": result["command"]}


def markdown(limits: dict[str, list[dict]], params: dict[str, int], checks: list[dict]) -> list[str]:
    lines = []
    for model, rows in limits.items():
        lines += [f"{model} ({params[model]:,} parameters): longest T predicted within {BUDGET_GIB:.0f} GiB on {RANKS} "
                  "ranks (dp 8 / cp)", "", "| cp | no checkpointing | selective |", "| --- | --- | --- |"]
        lines += [f"| {r['cp']} | {r['none']:,} | {r['selective']:,} |" for r in rows] + [""]
    if checks:
        lines += ["| model | cp | T | AC | peak tensor MiB (busiest rank) | predicted MiB | error | process peak MiB | "
                  "node GiB (x 8) | step s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in checks:
            measured, predicted = r["peak_tensor_bytes"], r["predicted_peak_tensor_bytes"]
            if not (r["ok"] and measured and predicted):
                lines.append(f"| {r['model']} | {r['cp']} | {r['seq_len']:,} | {r['ac']} | failed | | | | | |")
                continue
            lines.append(f"| {r['model']} | {r['cp']} | {r['seq_len']:,} | {r['ac']} | {measured / 2**20:.1f} | "
                         f"{predicted / 2**20:.1f} | {(predicted - measured) / measured:+.1%} | "
                         f"{r['process_peak_bytes'] / 2**20:.0f} | {r['node_bytes'] / 2**30:.2f} | {r['step_time_s']:.1f} |")
        lines += [""] + [f"- `{r['command']}`" for r in checks] + [""]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODEL_SHAPES]
    if unknown:
        raise SystemExit(f"--models: {', '.join(unknown)} unknown; valid: {', '.join(MODEL_SHAPES)}")
    checks = [parse_check(text) for text in args.check]
    out = Path(args.out or tempfile.mkdtemp(prefix="long_context_limit_"))
    out.mkdir(parents=True, exist_ok=True)
    limits = {m: limit_rows(MODEL_SHAPES[m]) for m in models}
    params = {m: parameter_count(MODEL_SHAPES[m]) for m in models}
    results = []
    for model, cp, seq_len in checks:
        # synthetic tokens: the built-in text fills no window past T ~46k in both splits (memory is the same)
        spec = check_spec(f"{model}_cp{cp}_T{seq_len}_{args.check_ac}", cp=cp, seq_len=seq_len,
                          shape=MODEL_SHAPES[model], flags=[*AC_FLAGS[args.check_ac], "--data", "synthetic"])
        run = execute(spec, out, timeout=args.timeout).to_dict()
        results.append(check_row({**run, "model": model, "ac": args.check_ac}))
    (out / "results.json").write_text(json.dumps({"limits": limits, "parameters": params, "checks": results}, indent=1))
    print("\n".join(markdown(limits, params, results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
