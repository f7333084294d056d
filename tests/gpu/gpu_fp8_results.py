"""``python -m tests.gpu.gpu_fp8_results OUT``: gather what tests/gpu/gpu_fp8.sh's steps wrote under OUT into
OUT/results.json: each step's file as it is, the headline figures beside them (FP8's tokens/s over bf16's, the
engine's step time over the plain loop's, the context-parallel rank's measured time over its price), and which
steps left nothing (a step that failed or timed out is named, the others are kept)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = {"blocks": "blocks.json", "step_profile": "step_profile/profiles.json", "moe_experts": "moe_experts.json",
         "cp_attention": "cp_attention.json"}


def headline(found: dict) -> dict:
    """The few numbers a reader wants first, from whichever steps ran."""
    out = {}
    blocks = found.get("blocks")
    if blocks:
        rows = {r["fp8"] or "bf16": r for r in blocks["rows"]}
        base = rows.get("bf16")
        for name, r in rows.items():
            out[f"blocks_{name}_tokens_per_sec"] = r["tokens_per_sec"]
            out[f"blocks_{name}_mfu_bf16_peak"] = r["mfu_bf16_peak"]
            if base and name != "bf16":
                out[f"blocks_{name}_speedup_over_bf16"] = r["tokens_per_sec"] / base["tokens_per_sec"]
    profiles = found.get("step_profile")
    if profiles:
        engine = [v.get("step_time_s") for k, v in profiles.items() if k.startswith("timed_engine")]
        plain = [v.get("step_time_s") for k, v in profiles.items() if k.startswith("timed_plain")]
        if engine and plain and None not in engine + plain:
            out["engine_vs_plain_loop_speed"] = min(plain) / min(engine)
    cp = found.get("cp_attention")
    if cp:
        out["cp_rank_attention_ms"] = max(cp["rank_0_ms"], cp[f"rank_{cp['shape']['cp'] - 1}_ms"])
        out["cp_rank_attention_over_price"] = out["cp_rank_attention_ms"] / cp["planner"]["attention_ms"]
    return out


def gather(folder: Path) -> dict:
    found, missing = {}, []
    for step, name in STEPS.items():
        path = folder / name
        try:
            found[step] = json.loads(path.read_text())
        except (OSError, ValueError):
            missing.append(step)
    return {"headline": headline(found), "missing": missing, **found}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.gpu.gpu_fp8_results OUT (the folder gpu_fp8.sh wrote)", file=sys.stderr)
        return 2
    folder = Path(args[0])
    result = gather(folder)
    (folder / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["headline"], indent=1), f"\nmissing: {result['missing'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
