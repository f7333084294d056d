"""Llama-3-8B-shaped blocks on one GPU, bf16 against each FP8 recipe: tokens/s and MFU of the blocks' forward and
backward at T 8192 (one sequence), with the planner's price of the same work beside each.

The blocks are the engine's Llama blocks (models/llama3), 4 of them, d 4096, 32 heads (8 kv), SwiGLU 14336; FP8
is the engine's swap (compiler/fp8 ``swap_linears``: q, k, v, o, gate, up, down) under bf16 autocast; the
kernels each recipe runs (torch's ``_scaled_mm`` or the emulation) are whatever compiler/fp8/kernels.py's probes
find on this device, and the result says which. MFU counts the model's FLOPs (6 per parameter and token, causal
attention's 6 T q_width per token and layer) over the datasheet's dense bf16 peak, and for FP8 runs also over
its FP8 peak (compiler/clusters/*.json).

Run from the repository root: ``python -m tests.gpu.gpu_fp8_blocks OUT.json`` (tests/gpu/gpu_fp8.sh runs it);
``--dry-run``: two tiny blocks at T 256 on the CPU (tests/gpu/test_gpu_fp8_scripts.py runs that).
"""

from __future__ import annotations

import argparse
import json

import torch

from compiler.fp8 import RECIPES, swap_linears
from compiler.fp8.kernels import _PROBED
from compiler.planner.cluster import load_cluster
from compiler.planner.engines import THIS_ENGINE
from compiler.planner.shape import DENSE, DecoderShape
from compiler.planner.work import block_work
from models import named_config, spec_of
from tests.gpu.gpu_timing import median_ms

GPU_SHAPE = dict(n_layers=4, seq_len=8192)
DRY_SHAPE = dict(n_layers=1, seq_len=64, d_model=128, n_heads=2, n_kv_heads=1, mlp_width=256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.gpu_fp8_blocks", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the results' JSON file")
    p.add_argument("--recipes", default=",".join(RECIPES), help="FP8 recipes to time beside bf16 (comma-separated)")
    p.add_argument("--repeats", type=int, default=10, help="timed forward + backward passes per configuration")
    p.add_argument("--dry-run", action="store_true", help="tiny blocks on the CPU: the script's plumbing only")
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes.split(",") if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
    return args


def block_flops(cfg) -> float:
    """Training FLOPs of the blocks for one sequence: 6 per linear parameter and token, causal attention's
    6 T q_width per token and layer (the half of 12 T q_width a causal kernel runs)."""
    q_width = cfg.n_heads * cfg.head_dim
    kv_width = cfg.n_kv_heads * cfg.head_dim
    linear = cfg.d_model * (2 * q_width + 2 * kv_width) + 3 * cfg.d_model * cfg.mlp_width
    return cfg.n_layers * cfg.seq_len * (6 * linear + 6 * cfg.seq_len * q_width)


def planner_seconds(cfg, cluster, fp8: str | None) -> float:
    """The planner's forward + backward seconds of the same blocks (compiler/planner/work.py, devices.py)."""
    shape = DecoderShape.from_config(cfg)
    work = block_work(shape, DENSE, micro_batch_size=1, mp=1, cp=1, ep=1, precision="bf16", sequence_parallel=False,
                      traits=THIS_ENGINE, fp8=fp8)
    device = cluster.device
    seconds = device.compute(work, "bf16", linear_peak=device.peak_flops.get("fp8") if fp8 else None)
    return cfg.n_layers * (seconds.forward + seconds.backward)


def time_blocks(cfg, device: str, fp8: str | None, repeats: int) -> float:
    """Median milliseconds of one sequence's forward and backward through the blocks (bf16 autocast)."""
    torch.manual_seed(0)
    with torch.device(device):
        layers = spec_of(cfg).build(cfg).layers
    if fp8:
        swap_linears(layers, RECIPES[fp8])
    x = torch.randn(1, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)
    grad = torch.randn(1, cfg.seq_len, cfg.d_model, device=device, dtype=torch.bfloat16)

    def once():
        x.grad = None
        for p in layers.parameters():
            p.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            h = x
            for block in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
                h = block(h)
        h.backward(grad.to(h.dtype))

    return median_ms(once, repeats=repeats)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    cfg = named_config("llama3-8b", **(DRY_SHAPE if device == "cpu" else GPU_SHAPE))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    cluster = load_cluster("h200-141gb" if "H200" in name else "h100-80gb")
    peak = cluster.device.peak_flops
    flops = block_flops(cfg)
    rows = []
    for fp8 in (None, *args.recipes.split(",")):
        ms = time_blocks(cfg, device, fp8, args.repeats)
        row = {"fp8": fp8, "ms": ms, "tokens_per_sec": cfg.seq_len / (ms * 1e-3),
               "mfu_bf16_peak": flops / (ms * 1e-3) / peak["bf16"],
               "mfu_fp8_peak": flops / (ms * 1e-3) / peak["fp8"] if fp8 else None,
               "planner_ms": planner_seconds(cfg, cluster, fp8) * 1e3}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": name, "torch": torch.__version__, "cluster": cluster.name, "dry_run": device == "cpu",
              "shape": {"layers": cfg.n_layers, "seq_len": cfg.seq_len, "d_model": cfg.d_model},
              "flops_per_step": flops, "rows": rows,
              "kernels": {repr(key): ran for key, ran in _PROBED.items()}}  # which scaled GEMMs ran, which emulated
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
