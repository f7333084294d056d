"""Timing for the one-GPU scripts (tests/gpu/gpu_*.py): the median of a callable's repeats, by CUDA events on a GPU
(the device's time, the host waiting once per repeat) and by the host clock on a CPU (their dry runs)."""

from __future__ import annotations

import time

import torch


def median_ms(fn, *, repeats: int, warmups: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, after ``warmups`` untimed ones."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]
