"""The experts' grouped products on one GPU against the planner's price of them, by tokens per expert.

Why: the published Qwen3-235B rows (compiler/published/megatron_moe_qwen3_235b.json) report less per-GPU
throughput where each expert gets fewer tokens (245-276 TFLOP/s at ~4,096 tokens per expert, 200 at 1,024,
167 at 512), while the planner discounts a grouped product only by m / (m + 128) rows (compiler/planner/
devices.py ``GemmEfficiency.rows``). Whether the device does worse than that is a measurement, not a fit to
those rows: this times the engine's own operator (``torch.ops.moe.grouped_mm``, torch's grouped GEMM on SM90+),
forward and both gradients, for a SwiGLU expert's two products, and prints beside each the planner's seconds
for the same product and the reduction-curve fit of the measured fractions of peak in m
(``GemmEfficiency.fit`` on (m, fraction) points: its ``k_half`` is then the rows' half-point).

Run from the repository root on a GPU: ``python -m tests.gpu.gpu_moe_experts OUT.json`` (on a CPU: a dry run at
small sizes). Shapes: Qwen3-235B-A22B's experts (d 4096, width 1536) and Qwen3-30B-A3B's (d 2048, width 768),
16 and 4 experts per rank (EP 8 and 32 of 128): at equal tokens per expert, a time per token that grows with the
experts per rank would be a per-expert cost (compiler/README.md, "Left over 25%": the second reading)."""

from __future__ import annotations

import json
import sys

import torch

from compiler.planner.cluster import load_cluster
from compiler.planner.devices import Gemm, GemmEfficiency
from models.common.grouped_mm import grouped_mm  # noqa: F401 (registers torch.ops.moe.grouped_mm, its CUDA kernel too)
from tests.gpu.gpu_timing import median_ms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16
SHAPES = ((4096, 1536), (2048, 768)) if DEVICE == "cuda" else ((256, 128),)  # (d_model, expert width)
EXPERTS = (16, 4) if DEVICE == "cuda" else (4,)
TOKENS_PER_EXPERT = (128, 256, 512, 1024, 2048, 4096, 8192) if DEVICE == "cuda" else (16, 64)
REPEATS = 10


def product_ms(m: int, k: int, n: int, experts: int) -> float:
    """Forward + both gradients of x (experts x m, k) by w (experts, n, k), rows sorted by expert."""
    x = torch.randn(experts * m, k, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = (torch.randn(experts, n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5).requires_grad_()
    offsets = torch.arange(1, experts + 1, device=DEVICE, dtype=torch.int32) * m
    grad = torch.randn(experts * m, n, device=DEVICE, dtype=DTYPE)

    def once():
        x.grad = w.grad = None
        torch.ops.moe.grouped_mm(x, w, offsets).backward(grad)
    return median_ms(once, repeats=REPEATS)


def main(out_path: str) -> None:
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    cluster = load_cluster("h200-141gb-engine" if "H200" in name else "h100-80gb-engine")
    device = cluster.device
    peak = device.peak("bf16")
    rows = []
    for d, width in SHAPES:
        for experts in EXPERTS:
            for m in TOKENS_PER_EXPERT:
                for label, (k, n) in (("gate_up", (d, 2 * width)), ("down", (width, d))):
                    ms = product_ms(m, k, n, experts)
                    g = Gemm(m, n, k, groups=experts)
                    forward, backward = device._products(g, peak, True, itemsize=2)
                    rows.append({"d_model": d, "width": width, "experts": experts, "tokens_per_expert": m,
                                 "product": label, "ms": ms, "planner_ms": (forward + backward) * 1e3,
                                 "fraction_of_peak": 3 * g.flops / (ms * 1e-3) / peak})
                    print(json.dumps(rows[-1]), flush=True)
    fits = {}
    for d, width in SHAPES:
        for experts in EXPERTS:
            points = {}
            for r in rows:
                if (r["d_model"], r["experts"]) == (d, experts):
                    points.setdefault(r["tokens_per_expert"], []).append(r["fraction_of_peak"])
            curve = GemmEfficiency.fit([(m, sum(f) / len(f)) for m, f in points.items()])
            fits[f"d{d}_e{experts}"] = {"max_efficiency": curve.max_efficiency, "rows_half": curve.k_half}
    result = {"device": name, "torch": torch.__version__, "cluster": cluster.name, "rows": rows,
              "fit_fraction_vs_tokens_per_expert": fits}
    print(json.dumps(fits, indent=1))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe_experts.json")
