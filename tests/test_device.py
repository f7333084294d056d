"""runtime/device.py: one device per rank (--device, checked with a fake device count) and the CPU heap
settings: retained by default (no page faults per micro-batch), compact with --compact-cpu-memory."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runtime import device as device_module
from runtime.commands.train import check_inputs
from runtime.config import ConfigError
from runtime.device import configure_fp32_matmuls, device_shortage, select_device
from runtime.distributed.process_group import LaunchEnv

ROOT = Path(__file__).resolve().parent.parent

# Frees 63 of 64 touched 5 MiB tensors after glibc's dynamic threshold has risen above 5 MiB (a freed
# 6 MiB block) and prints how much of the 320 MiB stays resident.
PROBE = textwrap.dedent("""
    import sys, torch
    from runtime.device import compact_cpu_heap
    if sys.argv[1] == "compact":
        assert compact_cpu_heap()
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    torch.ones(6 * 2**20 // 4).sum()
    before = rss()
    blocks = [torch.ones(5 * 2**20 // 4) for _ in range(64)]
    keep = blocks[-1]
    del blocks
    print((rss() - before) / 2**20)
""")


GLIBC_ONLY = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only")


def _probe(script: str, mode: str) -> float:
    """Run ``script`` in a fresh process (the heap settings are process-wide) and return its last number."""
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@GLIBC_ONLY
def test_compact_heap_returns_freed_tensors_to_the_kernel():
    assert _probe(PROBE, "default") > 200  # glibc's heap keeps the freed blocks resident (MiB)
    assert _probe(PROBE, "compact") < 20  # only the one kept tensor (5 MiB) stays


# A pipeline step in miniature: 48 MiB of 1 MiB activations held, then freed, five times; prints the page
# faults of the last four rounds (the first one grows the heap in either mode).
CYCLE = textwrap.dedent("""
    import resource, sys, torch
    from runtime.device import retain_cpu_heap
    if sys.argv[1] == "retain":
        assert retain_cpu_heap()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for round in range(5):
        if round == 1:
            start = faults()
        held = [torch.ones(2**20 // 4) for _ in range(48)]
        del held
    print(faults() - start)
""")


@GLIBC_ONLY
def test_retained_heap_reuses_freed_activations_without_page_faults():
    pages = 4 * 48 * 2**20 // 4096  # what faulting every activation back in would cost: 49,152
    assert _probe(CYCLE, "default") > pages // 4  # glibc trims the freed top of its heap (measured: half)
    assert _probe(CYCLE, "retain") < pages // 20


def test_batches_stay_as_they_are_on_the_cpu():
    import torch

    from runtime.device import host_to_device

    batch = torch.arange(12).view(3, 4)
    assert host_to_device(batch, torch.device("cpu")) is batch  # no copy, no page-locking


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs CUDA")
def test_batches_reach_cuda_through_page_locked_memory(monkeypatch):
    import torch

    from runtime.device import host_to_device

    pinned = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pinned.append(out := real(self, *a)) or out)
    batch = torch.arange(12).view(3, 4)
    moved = host_to_device(batch, torch.device("cuda", 0))
    assert moved.is_cuda and len(pinned) == 1 and pinned[0].is_pinned()
    torch.testing.assert_close(moved.cpu(), batch)


# --- one device per rank (--device) ----------------------------------------------------------------------

class FakeAccelerator:
    """``torch.accelerator`` of a machine with ``count`` CUDA devices; records the device each rank takes."""

    def __init__(self, count: int):
        self.count, self.chosen = count, []

    def is_available(self) -> bool:
        return self.count > 0

    def current_accelerator(self):
        return torch.device("cuda")

    def device_count(self) -> int:
        return self.count

    def set_device_index(self, index: int) -> None:
        self.chosen.append(index)


@pytest.fixture
def one_gpu(monkeypatch):
    fake = FakeAccelerator(1)
    monkeypatch.setattr(device_module.torch, "accelerator", fake)
    return fake


def test_more_ranks_than_gpus_is_an_input_error_naming_both_counts_and_the_fixes(one_gpu):
    env = LaunchEnv(rank=0, world_size=8, local_rank=0, local_world_size=8)
    with pytest.raises(ConfigError) as raised:
        check_inputs(["--model", "tiny", "--dp", "8", "--steps", "1"], env)  # --device auto finds the GPU
    line = str(raised.value)
    for words in ("--device cuda", "8 ranks on this node but 1 cuda device", "--nproc_per_node=1", "--device cpu"):
        assert words in line, line
    assert "\n" not in line


def test_a_rank_takes_the_device_of_its_local_rank_never_a_shared_one(one_gpu):
    assert select_device(0, "cuda") == torch.device("cuda", 0) and one_gpu.chosen == [0]
    with pytest.raises(RuntimeError, match="2 ranks on this node but 1 cuda device"):
        select_device(1, "cuda")  # the old local_rank % device_count() put it on cuda:0 beside rank 0
    assert one_gpu.chosen == [0]


def test_device_cpu_runs_gloo_on_a_gpu_machine(one_gpu):
    env = LaunchEnv(rank=0, world_size=8, local_rank=3, local_world_size=8)
    cfg, _, _ = check_inputs(["--model", "tiny", "--dp", "8", "--steps", "1", "--device", "cpu"], env)
    assert cfg.device == "cpu"
    device = select_device(env.local_rank, cfg.device)
    assert device == torch.device("cpu") and one_gpu.chosen == []
    assert device_module.backend_for(device) == "gloo"


def test_one_rank_per_gpu_fits_and_the_cpu_is_never_short():
    assert device_shortage("cuda", local_world_size=8, available=8) is None
    assert device_shortage("cpu", local_world_size=64, available=0) is None
    assert "no cuda device is visible" in device_shortage("cuda", local_world_size=1, available=0)


# --- fast bf16: the default precision's detection ---------------------------------------------------------

@pytest.mark.parametrize("flags, fast", [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True),
                                         ({"amx_tile", "amx_bf16"}, True)])
def test_a_cpu_computes_bf16_fast_only_with_avx512_bf16_or_amx(monkeypatch, flags, fast):
    monkeypatch.setattr(device_module, "cpu_flags", lambda: flags)
    assert device_module.has_fast_bf16("cpu") is fast


@pytest.mark.parametrize("major, fast", [(7, False), (8, True), (9, True)])
def test_a_gpu_computes_bf16_fast_from_compute_capability_8(monkeypatch, major, fast):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # torch's own test (2.11 and 2.13): native bf16 from compute capability 8.0; emulation does not count
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: major >= 8 or including_emulation)
    assert device_module.has_fast_bf16("cuda") is fast


def test_cpu_flags_are_read_from_proc_cpuinfo():
    flags = device_module.cpu_flags()
    assert not flags or "fpu" in flags  # every x86 CPU lists fpu; elsewhere there may be no flags line


@pytest.mark.parametrize(("device", "precision", "tf32"), [
    ("cuda", "fp32", True), ("cuda", "bf16", False), ("cpu", "fp32", False)])
def test_fp32_on_cuda_computes_matrix_products_in_tf32(device, precision, tf32):
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        configure_fp32_matmuls(torch.device(device), precision)  # a cuda device object needs no GPU
        assert (torch.get_float32_matmul_precision() == "high") is tf32
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
    finally:
        torch.set_float32_matmul_precision(before)
