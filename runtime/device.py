"""Every device-specific call lives here, through ``torch.accelerator``: the engine runs on whatever
accelerator torch finds (CUDA, XPU, ...) with its default collective backend (NCCL, XCCL, ...), and on
the CPU with gloo when there is none."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import resource

import torch
import torch.distributed as dist


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def select_device(local_rank: int) -> torch.device:
    if not has_accelerator():
        return torch.device("cpu")
    index = local_rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)


def backend_for(device: torch.device) -> str:
    return dist.get_default_backend_for_device(device)


def configure_cpu_threads(local_world_size: int) -> int:
    """Give each rank on this machine an equal share of the cores (at least one thread)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
COMPACT_MMAP_THRESHOLD = 4 * 2**20


def compact_cpu_heap() -> bool:
    """Make glibc serve allocations of 4 MiB or more with their own mappings, returned to the kernel when
    freed. By default glibc raises that threshold to the largest block freed so far (up to 32 MiB), after
    which a training step's many mid-sized tensors come from the heap, whose free holes stay resident: on
    GPT-2 Large layers at 2x2x2 that doubled the ranks' resident memory over their live tensors (measured:
    18.8 -> 13.0 GB used by 8 ranks). Fixing the threshold also turns off that adjustment. Returns False
    where there is no glibc (other C libraries, macOS)."""
    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, COMPACT_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (in host memory) on ``device``. To an accelerator the bytes go through page-locked
    memory, and the host does not wait for the copy (what DataLoader's ``pin_memory`` does): from pageable
    memory the driver first stages them itself, synchronously. On the CPU: the tensor itself."""
    if device.type == "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank.

    Accelerator: ``max_memory_allocated`` (tensor memory the caching allocator handed out).
    CPU: the peak resident set size of the process (Linux: VmHWM; elsewhere ``getrusage`` ru_maxrss), a
    real measurement that also includes the interpreter, libraries and allocator slack.
    """
    if device.type != "cpu":
        return int(torch.accelerator.max_memory_allocated(device))
    return _max_rss_bytes()


def current_memory_bytes(device: torch.device) -> int:
    if device.type != "cpu":
        return int(torch.accelerator.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    # Not ru_maxrss on Linux: the kernel carries the parent's RSS at fork into the child's ru_maxrss across
    # exec, so a rank spawned by a large process (a test runner, a notebook) would report the parent's size.
    # VmHWM is the high-water mark of this process's own address space.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if platform.system() == "Darwin" else rss * 1024)  # Linux reports KiB


def device_description(device: torch.device) -> str:
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        name = backend.get_device_name(device) if hasattr(backend, "get_device_name") else device.type
        return f"{name} ({torch.accelerator.device_count()} x {device.type})"
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
