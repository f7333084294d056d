"""One context-parallel rank's attention at 128k tokens on one GPU, timed beside the planner's price.

Under ``--cp N`` (compiler/parallelize/context_parallel.py) rank c holds chunks c and 2N-1-c of a sequence cut into
2N, gathers every rank's keys and values, and runs each chunk's queries against the keys before it (no mask) and
its own (causally): ``causal_run_attention``. This times that call for Llama-3-8B's attention (32 query heads, 8
key/value heads of 128) at T 131,072 and cp 8 (16,384 queries a rank), forward and backward in bf16, on the first
rank and the last (the head-tail balance gives both the same causal work), and prints the planner's seconds for
that rank's attention (compiler/planner/devices.py: the flash FLOPs at the GEMM efficiency of the head dimension,
backward 2.5x) and for the all-gather of K and V over 8 ranks of a node (collectives.py), which one GPU cannot time.

Run from the repository root: ``python -m tests.gpu.gpu_cp_attention OUT.json`` (tests/gpu/gpu_fp8.sh runs it);
``--dry-run``: T 512, cp 2, small heads on the CPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from compiler.parallelize.context_parallel import causal_run_attention
from compiler.planner.cluster import load_cluster
from compiler.planner.collectives import all_gather_time
from tests.gpu.gpu_timing import median_ms

GPU = dict(seq_len=131072, cp=8, heads=32, kv_heads=8, head_dim=128)
DRY = dict(seq_len=512, cp=2, heads=4, kv_heads=2, head_dim=16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.gpu_cp_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the results' JSON file")
    p.add_argument("--repeats", type=int, default=5, help="timed forward + backward passes per rank")
    p.add_argument("--dry-run", action="store_true", help="a small sequence on the CPU: the script's plumbing only")
    return p.parse_args(argv)


def rank_attention_ms(shape: dict, rank: int, device: str, repeats: int) -> float:
    """Forward + backward of rank ``rank``'s two chunks of queries against the gathered keys and values."""
    T, cp, hd = shape["seq_len"], shape["cp"], shape["head_dim"]
    run = T // (2 * cp)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, shape["heads"], 2 * run, hd, device=device, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(1, shape["kv_heads"], T, hd, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(1, shape["heads"], 2 * run, hd, device=device, dtype=dtype, generator=g)
    starts = (rank * run, (2 * cp - 1 - rank) * run)

    def once():
        q.grad = k.grad = v.grad = None
        out = torch.cat([causal_run_attention(q[:, :, i * run:(i + 1) * run], k[:, :, :a + run], v[:, :, :a + run],
                                              prefix=a) for i, a in enumerate(starts)], dim=2)
        out.backward(grad)

    return median_ms(once, repeats=repeats)


def planner_ms(shape: dict, cluster) -> dict:
    """The planner's price of one rank's attention (compute) and of the K/V all-gather within a node."""
    device, T, cp = cluster.device, shape["seq_len"], shape["cp"]
    rows = T / cp
    flash = 4.0 * rows * T * shape["heads"] * shape["head_dim"] / 2  # the causal half (compiler/planner/work.py)
    e = device.gemm.efficiency(shape["head_dim"])
    peak = device.peak("bf16")
    kv_bytes = T * 2 * shape["kv_heads"] * shape["head_dim"] * 2  # K and V of the whole sequence, bf16
    link = cluster.topology.group_link(cp, 1)
    return {"attention_ms": 3.5 * flash / (peak * e) * 1e3,
            "kv_all_gather_ms": 2 * all_gather_time(kv_bytes, cp, link) * 1e3}  # forward gather, backward scatter


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    shape = DRY if device == "cpu" else GPU
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    cluster = load_cluster("h200-141gb" if "H200" in name else "h100-80gb")
    measured = {f"rank_{r}_ms": rank_attention_ms(shape, r, device, args.repeats) for r in (0, shape["cp"] - 1)}
    result = {"device": name, "torch": torch.__version__, "cluster": cluster.name, "dry_run": device == "cpu",
              "shape": shape, **measured, "planner": planner_ms(shape, cluster)}
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
