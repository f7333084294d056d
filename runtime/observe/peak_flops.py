"""The peak FLOP/s that MFU divides by: a GPU's datasheet peak, a measured one for a GPU not in the table, the
CPU's measured concurrent matmul rate, or ``--peak-tflops``.

MFU (PaLM, appendix B) is the model's FLOPs per second over the hardware's *peak*, so on a GPU the peak is
the vendor's dense (no 2:4 sparsity) tensor-core figure for the precision the matrix products run in, as
torchtitan and Megatron report it; a measured rate would make MFU describe the benchmark, not the model.
The numerator, model FLOPs per token, is counted in compiler/flops.py.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.device import synchronize


@dataclass(frozen=True)
class DatasheetPeak:
    """Dense peak TFLOP/s of one GPU model: tensor cores for bf16, fp16 (FP32 accumulate) and TF32, the
    CUDA cores for plain fp32. NVIDIA prints tensor-core figures "with sparsity": dense is half of them."""

    model: str
    pattern: str  # regular expression on torch.cuda.get_device_name(), lower case
    bf16: float
    fp16: float
    tf32: float
    fp32: float
    source: str


# Most specific first: "H100 NVL" and "H100 PCIe" before every other H100 (SXM: "NVIDIA H100 80GB HBM3").
DATASHEET_PEAKS: tuple[DatasheetPeak, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column, per GPU): BF16/FP16 1,671*, TF32 835*, FP32 60.
    DatasheetPeak("NVIDIA H100 NVL", r"h100.*nvl", 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 datasheet, H100 NVL"),
    # Same datasheet, H100 PCIe column: BF16/FP16 1,513*, TF32 756*, FP32 51.
    DatasheetPeak("NVIDIA H100 PCIe", r"h100.*pcie", 756.5, 756.5, 378.0, 51.0, "NVIDIA H100 datasheet, H100 PCIe"),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, table "H100 SXM5": FP16/BF16 Tensor with FP32
    # accumulate 989.4 (1,978.9 sparse), TF32 Tensor 494.7, FP32 66.9 (the datasheet rounds: 1,979*, 989*, 67).
    DatasheetPeak("NVIDIA H100 SXM", r"h100", 989.4, 989.4, 494.7, 66.9, "NVIDIA H100 whitepaper, H100 SXM5"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 NVL: BF16/FP16 1,671*, TF32 835*, FP32 60.
    DatasheetPeak("NVIDIA H200 NVL", r"h200.*nvl", 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 datasheet, H200 NVL"),
    # Same datasheet, H200 SXM: BF16/FP16 1,979*, TF32 989*, FP32 67 (the H100 SXM5's GH100 at its clocks).
    DatasheetPeak("NVIDIA H200 SXM", r"h200", 989.4, 989.4, 494.7, 66.9, "NVIDIA H200 datasheet, H200 SXM"),
    # NVIDIA A100 Tensor Core GPU datasheet (40 and 80 GB, SXM and PCIe alike): BF16/FP16 312 (624*),
    # TF32 156 (312*), FP32 19.5.
    DatasheetPeak("NVIDIA A100", r"a100", 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 datasheet"),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 (733*), TF32 183 (366*), FP32 91.6.
    DatasheetPeak("NVIDIA L40S", r"l40s", 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: BF16/FP16 242*, TF32 120*, FP32 30.3.
    DatasheetPeak("NVIDIA L4", r"\bl4\b", 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet"),
    # NVIDIA A10 datasheet: BF16/FP16 125 (250*), TF32 62.5 (125*), FP32 31.2. (Not AWS's A10G: NVIDIA
    # publishes no datasheet for it, so an A10G is measured.)
    DatasheetPeak("NVIDIA A10", r"\ba10\b", 125.0, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet"),
    # NVIDIA Ada GPU Architecture whitepaper, appendix table for the GeForce RTX 4090: FP16/BF16 Tensor with
    # FP32 accumulate 165.2 (330.4*), TF32 Tensor 82.6 (165.2*), FP32 82.6.
    DatasheetPeak("NVIDIA GeForce RTX 4090", r"rtx 4090", 165.2, 165.2, 82.6, 82.6, "NVIDIA Ada whitepaper, RTX 4090"),
)


def datasheet_peak(device_name: str) -> DatasheetPeak | None:
    name = device_name.lower()
    return next((row for row in DATASHEET_PEAKS if re.search(row.pattern, name)), None)


def dense_tflops(row: DatasheetPeak, dtype: torch.dtype, *, tf32: bool) -> tuple[float, str]:
    """(TFLOP/s, the column) for matrix products in ``dtype``; fp32 products use the tensor cores (TF32) only
    when torch allows it (``torch.set_float32_matmul_precision("high")``; torch's default is "highest")."""
    if dtype == torch.bfloat16:
        return row.bf16, "bf16"
    if dtype == torch.float16:
        return row.fp16, "fp16"
    return (row.tf32, "tf32") if tf32 else (row.fp32, "fp32")


@dataclass(frozen=True)
class RankPeak:
    flops: float  # FLOP/s of this rank
    source: str  # where the figure comes from, for the run's output and summary.json
    measured: bool


def rank_peak(dtype: torch.dtype, device: torch.device) -> RankPeak:
    """This rank's peak: the datasheet's for a known GPU, else measured (and said so)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        row = datasheet_peak(name)
        if row is not None:
            tflops, column = dense_tflops(row, dtype, tf32=torch.get_float32_matmul_precision() != "highest")
            return RankPeak(tflops * 1e12, f"datasheet: {row.model} dense {column} {tflops:g} TFLOP/s ({row.source})",
                            measured=False)
        return RankPeak(measure_device_matmul_flops(dtype, device),
                        f"measured: {name} is not in the datasheet table; large {_name(dtype)} matmuls timed with "
                        f"device events (MFU is relative to this, not to a datasheet)", measured=True)
    if device.type == "cpu":
        return RankPeak(best_matmul_flops(dtype, device),
                        f"measured: concurrent {_name(dtype)} matmul calibration on all ranks", measured=True)
    return RankPeak(measure_device_matmul_flops(dtype, device),
                    f"measured: {device.type} {_name(dtype)} matmuls timed with device events", measured=True)


def world_peak_flops(dtype: torch.dtype, device: torch.device, *, peak_tflops: float | None,
                     world_size: int) -> tuple[float, str]:
    """(FLOP/s of the whole world, source). ``peak_tflops`` (--peak-tflops, per rank) overrides. Collective
    otherwise: every rank finds its own peak at once (the CPU's ranks share cores and measure concurrently)
    and the ranks' peaks are summed."""
    if peak_tflops:
        return peak_tflops * 1e12 * world_size, f"--peak-tflops {peak_tflops} per rank"
    if dist.is_initialized():
        dist.barrier()
    peak = rank_peak(dtype, device)
    rate = torch.tensor([peak.flops], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(rate)
    return float(rate), peak.source


def measure_device_matmul_flops(dtype: torch.dtype, device: torch.device, *, size: int = 4096,
                                iterations: int = 50, warmup: int = 5) -> float:
    """FLOP/s of ``iterations`` back-to-back size^3 products in ``dtype`` between one pair of device events,
    after ``warmup`` products (kernel selection, clocks). Timing each small product with a host sync would
    measure launch latency (100-200 TFLOP/s on an H100, against 989 on the datasheet). 4096^3 keeps an H100's
    tensor cores busy (~0.2 ms a product in bf16) while its three operands stay under 200 MiB even in fp32:
    they count in the run's peak device memory."""
    x = torch.randn(size, size, device=device, dtype=dtype)
    w = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(warmup):
        F.linear(x, w)
    start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
    start.record()
    for _ in range(iterations):
        F.linear(x, w)
    end.record()
    end.synchronize()
    return 2.0 * size**3 * iterations / (start.elapsed_time(end) / 1000)


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, *, size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of this process on an n x n x n product in ``dtype``, timed for about ``seconds`` (CPU).

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
    """The best CPU rate over a few sizes, each measured twice: kernels reach their peak at different
    shapes, and a peak must not be lowered by a moment of interference on a shared machine. Measured
    while every rank measures, it is the honest peak when ranks share cores (8 ranks on 2 cores measure
    about 2 cores' worth in total)."""
    return max(measure_matmul_flops(dtype, device, size=n, seconds=0.15) for n in CALIBRATION_SIZES * 2)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
