"""Every device-specific call lives here, through ``torch.accelerator``: the engine runs on whatever
accelerator torch finds (CUDA, XPU, ...) with its default collective backend (NCCL, XCCL, ...), and on
the CPU with gloo when there is none."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import resource
from typing import Callable, Mapping

import torch
import torch.distributed as dist

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def resolve_device_type(requested: str) -> str:
    """``--device``: ``auto`` is the accelerator torch finds (``cuda``, ...) or ``cpu`` where there is none."""
    if requested == "auto":
        return torch.accelerator.current_accelerator().type if has_accelerator() else "cpu"
    return requested


def device_count(device_type: str) -> int:
    """Devices of that type this process can see (0 for ``cpu``: it is not counted per rank)."""
    if device_type == "cpu" or not has_accelerator() or torch.accelerator.current_accelerator().type != device_type:
        return 0
    return torch.accelerator.device_count()


# Where a launcher gives each process devices of its own (SLURM's --gpus-per-task, Kubernetes' device plugins,
# MPI wrappers): the process then sees only those, numbered from 0. ROCm builds of torch report "cuda" and
# honour HIP_VISIBLE_DEVICES as well.
VISIBLE_DEVICES_VARIABLES = {"cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"), "xpu": ("ZE_AFFINITY_MASK",)}


def visible_devices_setting(device_type: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``NAME=value`` of the variable restricting which ``device_type`` devices this process sees, or None
    where none is set (the process sees every device of the node)."""
    environ = os.environ if environ is None else environ
    return next((f"{name}={environ[name]}" for name in VISIBLE_DEVICES_VARIABLES.get(device_type, ())
                 if name in environ), None)


def device_assignment_error(device_type: str, *, local_world_size: int, visible: int,
                            environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``local_world_size`` ranks on this node, each seeing ``visible`` ``device_type`` devices, cannot
    each have a device of their own, or None when they can (``device_index`` says which). Two layouts work:
    every process sees one device, its own, because the launcher set ``CUDA_VISIBLE_DEVICES`` (or its
    kind's variable) per process; or every process sees the node's devices, at least one per local rank.
    NCCL refuses two ranks on one GPU at its first collective ("Duplicate GPU detected"), so anything
    else is an input error, not a device to share."""
    if device_type == "cpu":
        return None
    setting = visible_devices_setting(device_type, environ)
    variable = VISIBLE_DEVICES_VARIABLES.get(device_type, ("a visible-devices variable",))[0]
    why = f"({setting})" if setting else f"({variable} is unset)"
    if visible == 0:
        return (f"--device {device_type}: no {device_type} device is visible to this process {why}; use --device cpu "
                f"(gloo) or --device auto")
    if visible >= local_world_size or (visible == 1 and setting):
        return None
    seen = f"sees {visible} {device_type} device{'s' if visible != 1 else ''} {why}"
    return (f"--device {device_type}: {local_world_size} ranks on this node but each process {seen}; each rank "
            f"needs a device of its own (NCCL refuses two ranks on one GPU): start at most {visible} "
            f"rank{'s' if visible != 1 else ''} per node (torchrun --nproc_per_node={visible}), let the launcher "
            f"give each process one device ({variable} per process, e.g. srun --gpus-per-task=1), or train on "
            f"the CPU with gloo (--device cpu)")


def device_index(local_rank: int, *, visible: int) -> int:
    """The device this rank takes among the ``visible`` ones: its only one (the launcher gave each process
    its own), else local rank i takes device i (``device_assignment_error`` has checked there is one)."""
    return 0 if visible == 1 else local_rank


def select_device(local_rank: int, device_type: str | None = None, *, local_world_size: int = 1) -> torch.device:
    """This rank's device (``device_index``), or the CPU. ``device_type`` None: ``--device auto``."""
    device_type = resolve_device_type(device_type or "auto")
    if device_type == "cpu":
        return torch.device("cpu")
    visible = device_count(device_type)
    error = device_assignment_error(device_type, local_world_size=max(local_world_size, local_rank + 1),
                                    visible=visible)
    if error:
        raise RuntimeError(error)
    index = device_index(local_rank, visible=visible)
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def configure_fp32_matmuls(device: torch.device, precision: str) -> None:
    """``--precision fp32`` on CUDA: matrix products on the tensor cores in TF32 (fp32's range and accumulation,
    a 10-bit mantissa), as torchtitan and Megatron-LM train fp32, instead of torch's default "highest", which
    keeps them on the CUDA cores (H100 SXM: 67 TFLOP/s dense FP32 against 494.7 TF32, NVIDIA's datasheet).
    cuDNN convolutions already default to TF32. MFU's peak then takes the datasheet's TF32 column
    (runtime/observe/peak_flops.py reads the same setting). The CPU's products are left as they are."""
    if device.type == "cuda" and precision == "fp32":
        torch.set_float32_matmul_precision("high")


def has_fast_bf16(device_type: str) -> bool:
    """Whether bf16 matrix products run faster than fp32 here: CUDA from compute capability 8.0 (Ampere's
    bf16 tensor cores; ``is_bf16_supported(including_emulation=False)`` tests exactly that), a CPU with
    AVX-512 BF16 or AMX-BF16. A CPU without them converts in software: bf16 measured ~35x slower than
    fp32 on an AVX2-only AMD family 25 (shared/ENGINEERING_NOTES.md)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return False


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def backend_for(device: torch.device) -> str:
    return dist.get_default_backend_for_device(device)


def configure_cpu_threads(local_world_size: int) -> int:
    """Give each rank on this machine an equal share of the cores (at least one thread)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
COMPACT_MMAP_THRESHOLD = 4 * 2**20
# glibc's largest mapping threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc.c): what its dynamic
# adjustment reaches, fixed from the start.
RETAIN_MMAP_THRESHOLD = 32 * 2**20
RETAIN_TRIM_THRESHOLD = 256 * 2**20


def compact_cpu_heap() -> bool:
    """Make glibc serve allocations of 4 MiB or more with their own mappings, returned to the kernel when
    freed. By default glibc raises that threshold to the largest block freed so far (up to 32 MiB), after
    which a training step's many mid-sized tensors come from the heap, whose free holes stay resident: on
    GPT-2 Large layers at 2x2x2 that doubled the ranks' resident memory over their live tensors (measured:
    18.8 -> 13.0 GB used by 8 ranks). Fixing the threshold also turns off that adjustment. Returns False
    where there is no glibc (other C libraries, macOS)."""
    return _mallopt({M_MMAP_THRESHOLD: COMPACT_MMAP_THRESHOLD})


def retain_cpu_heap() -> bool:
    """Keep freed tensor memory in the process for the next micro-batch, as the CUDA caching allocator does,
    instead of giving it back to the kernel and faulting it in again page by page.

    glibc returns the top of its heap to the kernel once more than its trim threshold is free there (twice
    the largest block freed so far: a few MiB for a small model), and a pipeline's activations in flight
    grow and shrink the heap by tens of MiB within every step: thousands of page faults per step under the
    overlapping schedules, which these thresholds cut several-fold (runtime/README.md records the study). The
    peak resident memory is unchanged; it just stays there between steps (up to 256 MiB more per rank than
    glibc keeps). Returns False where there is no glibc."""
    return _mallopt({M_MMAP_THRESHOLD: RETAIN_MMAP_THRESHOLD, M_TRIM_THRESHOLD: RETAIN_TRIM_THRESHOLD})


def _mallopt(settings: dict[int, int]) -> bool:
    """Apply glibc ``mallopt(parameter, value)`` settings to this process; False where that is impossible."""
    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return all(libc.mallopt(parameter, value) for parameter, value in settings.items())
    except (OSError, AttributeError):
        return False


def stream_synchronizer(device: torch.device) -> Callable[[], None] | None:
    """A function that blocks until ``device``'s current stream has run what the host queued on it (None on
    the CPU, where the host does the work itself)."""
    if device.type == "cpu":
        return None
    return lambda: torch.accelerator.current_stream(device).synchronize()


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


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Accelerator: the caching allocator's peak reservation (``max_memory_reserved``: what the device sees
    taken, fragmentation included; the planner's reserve covers the gap to the tensors). CPU: None."""
    return None if device.type == "cpu" else int(torch.accelerator.max_memory_reserved(device))


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
