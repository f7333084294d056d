"""runtime/observe/peak_flops.py: MFU's peak from the GPU's datasheet (names as torch.cuda.get_device_name()
reports them, monkeypatched here), a measured peak said to be one, and --peak-tflops as the override."""

from __future__ import annotations

import pytest
import torch

from runtime.observe import peak_flops
from runtime.observe.peak_flops import datasheet_peak, dense_tflops, rank_peak, world_peak_flops

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("name, model, bf16", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", "NVIDIA H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100", 312.0),
    ("NVIDIA L40S", "NVIDIA L40S", 362.05),
    ("NVIDIA L4", "NVIDIA L4", 121.0),
    ("NVIDIA A10", "NVIDIA A10", 125.0),
    ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", 165.2),
])
def test_device_names_find_their_datasheet_row(name, model, bf16):
    row = datasheet_peak(name)
    assert row is not None and row.model == model and row.bf16 == bf16


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Tesla T4", "NVIDIA GeForce RTX 3090", "NVIDIA L40"])
def test_gpus_without_a_datasheet_row_are_not_guessed(name):
    assert datasheet_peak(name) is None


def test_fp32_products_use_the_tensor_cores_only_when_torch_allows_tf32():
    row = datasheet_peak("NVIDIA H100 80GB HBM3")
    assert dense_tflops(row, torch.float32, tf32=False) == (66.9, "fp32")
    assert dense_tflops(row, torch.float32, tf32=True) == (494.7, "tf32")
    assert dense_tflops(row, torch.float16, tf32=False) == (989.4, "fp16")


def test_a_known_gpu_reports_its_datasheet_peak_without_measuring(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(peak_flops, "measure_device_matmul_flops", lambda *a, **k: pytest.fail("measured a known GPU"))
    bf16 = rank_peak(torch.bfloat16, CUDA)
    assert bf16.flops == pytest.approx(989.4e12) and not bf16.measured
    assert bf16.source.startswith("datasheet: NVIDIA H100 SXM dense bf16 989.4 TFLOP/s")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert rank_peak(torch.float32, CUDA).flops == pytest.approx(66.9e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert rank_peak(torch.float32, CUDA).flops == pytest.approx(494.7e12)


def test_an_unknown_gpu_is_measured_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    calls = []
    monkeypatch.setattr(peak_flops, "measure_device_matmul_flops",
                        lambda dtype, device: calls.append((dtype, device)) or 70e12)
    peak = rank_peak(torch.bfloat16, CUDA)
    assert calls == [(torch.bfloat16, CUDA)] and peak.flops == 70e12 and peak.measured
    assert peak.source.startswith("measured: NVIDIA A10G is not in the datasheet table")


def test_peak_tflops_overrides_per_rank():
    assert world_peak_flops(torch.bfloat16, CUDA, peak_tflops=2.5, world_size=4) == (10e12, "--peak-tflops 2.5 per rank")
