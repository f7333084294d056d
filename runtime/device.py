"""Every device-specific call lives here: CUDA + NCCL when a GPU exists, else CPU + gloo."""

from __future__ import annotations

import os
import platform
import resource

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def select_device(local_rank: int) -> torch.device:
    if has_gpu():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def configure_cpu_threads(local_world_size: int) -> int:
    """Give each rank on this machine an equal share of the cores (at least one thread)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank.

    CUDA: ``max_memory_allocated`` (tensor memory the caching allocator handed out).
    CPU: the peak resident set size of the process (``getrusage`` ru_maxrss), a real measurement
    that also includes the interpreter, libraries and allocator slack; see ``baseline_memory_bytes``.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _max_rss_bytes()


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if platform.system() == "Darwin" else rss * 1024)  # Linux reports KiB


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"
