"""The peak FLOP/s that MFU divides by, measured on this machine (or given with --peak-tflops).

The numerator, model FLOPs per token, is counted in compiler/flops.py.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.device import synchronize


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, *, size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of this process on an n x n x n product in ``dtype``, timed for about ``seconds``.

    Uses ``F.linear`` (x @ w.T), the call ``nn.Linear`` makes: on CPU its fp16 kernel is several
    times faster than ``torch.mm``'s, and the peak must describe the kernels the model really uses.
    """
    x = torch.randn(size, size, device=device).to(dtype)
    w = torch.randn(size, size, device=device).to(dtype)
    F.linear(x, w)  # warm-up: kernel selection, first-touch of memory
    synchronize(device)
    n, start = 0, time.perf_counter()
    while True:
        F.linear(x, w)
        n += 1
        synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * n / elapsed


CALIBRATION_SIZES = (256, 512, 1024)


def best_matmul_flops(dtype: torch.dtype, device: torch.device) -> float:
    """The best rate over a few sizes, each measured twice: kernels reach their peak at different
    shapes, and a peak must not be lowered by a moment of interference on a shared machine."""
    return max(measure_matmul_flops(dtype, device, size=n, seconds=0.15) for n in CALIBRATION_SIZES * 2)


def calibrate_world_peak_flops(dtype: torch.dtype, device: torch.device) -> float:
    """Sum over ranks of the matmul rate each measures while all ranks measure at once.

    Measuring concurrently is the honest peak when ranks share cores (8 ranks on 2 cores measure
    about 2 cores' worth in total), and on GPUs it gives the achievable dense-matmul rate.
    """
    if dist.is_initialized():
        dist.barrier()
    rate = torch.tensor([best_matmul_flops(dtype, device)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(rate)
    return float(rate)
