"""Peak tensor memory of one training step, on any device.

CUDA has ``max_memory_allocated``. The CPU allocator keeps no statistics, but with
``torch.profiler(profile_memory=True)`` it reports every allocation and free; their running sum over
the step is the step's peak *growth* in live tensor bytes. Added to the bytes already live when the
step starts (parameters, optimizer state, the input batch) it gives the CPU counterpart of
``max_memory_allocated``: tensor memory only, without the interpreter, libraries and allocator slack
that the resident set size also counts.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

import torch
from torch.distributed.tensor import DTensor

from compiler.parallelize.float8 import master_weight
from runtime.device import current_memory_bytes, peak_memory_bytes, reset_peak_memory

T = TypeVar("T")


def live_tensor_bytes(tensors: Iterable[torch.Tensor | tuple | list | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shards counted once). An item may be a
    tuple or list of tensors (a batch's inputs with packed documents: (tokens, positions)). A weight FSDP gathers in
    FP8 (--fp8-all-gather) is a wrapper with no storage of its own: its high-precision shard's is counted."""
    seen: dict[int, int] = {}
    for t in _flatten(tensors):
        t = master_weight(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _flatten(items: Iterable) -> Iterator[torch.Tensor]:
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        elif item is not None:
            yield item


def step_state_tensors(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything a step starts with: parameters, their gradients, and the optimizer's state tensors."""
    tensors = [*params, *(p.grad for p in params)]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def peak_growth_during(fn: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak growth of live tensor bytes while it ran."""
    if device.type == "cuda":
        start = current_memory_bytes(device)
        reset_peak_memory(device)
        result = fn()
        return result, peak_memory_bytes(device) - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in deltas:
        running += nbytes
        peak = max(peak, running)
    return result, peak
