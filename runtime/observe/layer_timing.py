"""Measured per-layer cost: forward + backward time of each layer group on the real device.

The alternative to compiler/cost.py's counted FLOPs for ``--split-cost time`` and the study's split
benchmark: a large-vocabulary head's softmax and cache misses cost time that no FLOP count shows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from compiler.cost import LayerCost, layer_costs, layer_group_forwards
from compiler.precisions import PRECISIONS
from models import spec_of
from runtime.device import synchronize


def measure_layer_times(cfg, *, micro_batch_size: int, precision: str, device: torch.device,
                        repeats: int = 3) -> list[LayerCost]:
    """Like ``layer_costs``, with the median forward + backward time of each group on ``device``."""
    costs = layer_costs(cfg, micro_batch_size=micro_batch_size, precision=precision)
    model = spec_of(cfg).build(replace(cfg, n_layers=1)).to(device)
    runs = layer_group_forwards(model, seq_len=cfg.seq_len, micro_batch_size=micro_batch_size, device=device)
    seconds = {name: _time_fwd_bwd(fn, precision, device, repeats) for name, fn in runs.items()}
    return [replace(c, seconds=seconds["block" if c.name.startswith("layers.") else c.name]) for c in costs]


def _time_fwd_bwd(forward, precision: str, device: torch.device, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        with PRECISIONS[precision].autocast(device.type):
            out = forward()
        out.float().sum().backward()
        synchronize(device)
        if i:  # the first run warms up kernels and allocator
            times.append(time.perf_counter() - start)
    return statistics.median(times)
