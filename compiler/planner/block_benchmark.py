"""One transformer block's forward + backward timed on this CPU, one process and one thread: the compute
benchmark calibration fits its rates to (runtime/lab/calibrate.py) and the precision probe re-runs on another
CPU (compiler/planner/precision_probe.py). Torch only, no process group."""

from __future__ import annotations

import statistics
import time

import torch

from compiler.cost import layer_costs
from compiler.precisions import PRECISIONS
from models import named_config, spec_of

SHAPES = ((1, 32, 64, 4), (4, 128, 256, 4))  # (batch, seq, d_model, heads): overhead-bound, compute-bound
# A mixture-of-experts block (Mixtral's: 8 SwiGLU experts of width d, top 2) at the same two shapes: its router,
# top-k, token sort and per-expert products cost far more per counted FLOP than a dense block at small sizes
# (here: 16-24 ms against 13-17 ms forward + backward at the same FLOPs, batch 4, T 128, d 128).
MOE_BLOCK = dict(model="mixtral-debug", n_kv_heads=2)


def block_seconds(batch: int, seq: int, d: int, heads: int, precision: str, repeats: int = 3, *,
                  model: str = "tiny", **overrides) -> tuple[float, float]:
    """(median seconds, counted FLOPs) of one block's forward + backward (``model``: the named size whose block,
    resized to d_model ``d`` (and MLP or expert width d for a mixture of experts), is timed)."""
    if model != "tiny":
        overrides.setdefault("mlp_width", d)
    cfg = named_config(model, n_layers=1, d_model=d, n_heads=heads, seq_len=seq, vocab_size=256, **overrides)
    flops = layer_costs(cfg, micro_batch_size=batch, precision=precision)[1].flops
    block = spec_of(cfg).build(cfg).layers["0"]
    x = torch.randn(batch, seq, d, requires_grad=True)
    return statistics.median(forward_backward_seconds(block, x, precision, repeats)), flops


def forward_backward_seconds(block: torch.nn.Module, x: torch.Tensor, precision: str, repeats: int) -> list[float]:
    """Seconds of ``repeats`` forward + backward passes of ``block`` on ``x`` (after one warm-up)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        with PRECISIONS[precision].autocast("cpu"):
            out = block(x)
        out.float().sum().backward()
        if i:
            times.append(time.perf_counter() - start)
    return times
