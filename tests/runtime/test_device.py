"""runtime/device.py: one device per rank as clusters assign them (--device, checked with fake device counts and
CUDA_VISIBLE_DEVICES) and the CPU heap
settings: retained by default (no page faults per micro-batch), compact with --compact-cpu-memory."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime import device as device_module
from runtime.commands.train import check_inputs
from runtime.config import ConfigError
from runtime.device import configure_fp32_matmuls, device_assignment_error, device_index, select_device
from runtime.distributed.process_group import LaunchEnv
from tests.paths import ROOT

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


def _fake_gpus(monkeypatch, count: int, visible_devices: str | None = None) -> FakeAccelerator:
    """This process sees ``count`` CUDA devices; ``visible_devices``: the launcher's CUDA_VISIBLE_DEVICES."""
    fake = FakeAccelerator(count)
    monkeypatch.setattr(device_module.torch, "accelerator", fake)
    for name in device_module.VISIBLE_DEVICES_VARIABLES["cuda"]:
        monkeypatch.delenv(name, raising=False)
    if visible_devices is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_devices)
    return fake


@pytest.fixture
def one_gpu(monkeypatch):
    return _fake_gpus(monkeypatch, 1)


def _check(env: LaunchEnv, *flags: str):
    return check_inputs(["--model", "tiny", "--dp", str(env.world_size), "--steps", "1", *flags], env)


def test_ranks_sharing_the_one_gpu_they_see_is_an_input_error_naming_the_counts_and_the_fixes(one_gpu):
    env = LaunchEnv(rank=0, world_size=8, local_rank=0, local_world_size=8)
    with pytest.raises(ConfigError) as raised:
        _check(env)  # --device auto finds the GPU
    line = str(raised.value)
    for words in ("--device cuda", "8 ranks on this node but each process sees 1 cuda device (CUDA_VISIBLE_DEVICES "
                  "is unset)", "--nproc_per_node=1", "CUDA_VISIBLE_DEVICES per process", "--gpus-per-task=1",
                  "--device cpu"):
        assert words in line, line
    assert "\n" not in line
    with pytest.raises(RuntimeError, match="2 ranks on this node but each process sees 1 cuda device"):
        select_device(1, "cuda", local_world_size=2)  # the old local_rank % device_count() put it on cuda:0 too
    assert one_gpu.chosen == []


@pytest.mark.parametrize("variable", ["0", "3", "GPU-8f1e2a"])  # srun --gpus-per-task=1 sets one index or UUID
def test_a_launcher_that_gives_each_process_one_gpu_puts_every_local_rank_on_its_device_0(monkeypatch, variable):
    fake = _fake_gpus(monkeypatch, 1, visible_devices=variable)
    for local_rank in range(8):
        env = LaunchEnv(rank=8 + local_rank, world_size=16, local_rank=local_rank, local_world_size=8)
        cfg, _, _ = _check(env)
        assert cfg.device == "cuda"
        assert select_device(local_rank, cfg.device, local_world_size=8) == torch.device("cuda", 0)
    assert fake.chosen == [0] * 8


@pytest.mark.parametrize("visible_devices", [None, "0,1,2,3,4,5,6,7", "7,6,5,4,3,2,1,0"])
def test_with_a_device_per_local_rank_in_view_local_rank_i_takes_device_i(monkeypatch, visible_devices):
    fake = _fake_gpus(monkeypatch, 8, visible_devices=visible_devices)
    for local_rank in range(8):
        env = LaunchEnv(rank=local_rank, world_size=8, local_rank=local_rank, local_world_size=8)
        _check(env)
        assert select_device(local_rank, "cuda", local_world_size=8) == torch.device("cuda", local_rank)
    # fewer ranks than devices (torchrun --nproc_per_node=4 on an 8-GPU node): the rest stay idle
    _check(LaunchEnv(rank=3, world_size=4, local_rank=3, local_world_size=4))
    assert select_device(3, "cuda", local_world_size=4) == torch.device("cuda", 3)
    assert fake.chosen == [0, 1, 2, 3, 4, 5, 6, 7, 3]


def test_some_devices_per_process_but_fewer_than_its_local_ranks_is_one_line_naming_the_variable(monkeypatch):
    fake = _fake_gpus(monkeypatch, 2, visible_devices="4,5")  # e.g. srun --gpus-per-task=2 under torchrun x 4
    env = LaunchEnv(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(ConfigError) as raised:
        _check(env)
    line = str(raised.value)
    for words in ("--device cuda: 4 ranks on this node but each process sees 2 cuda devices "
                  "(CUDA_VISIBLE_DEVICES=4,5)", "--nproc_per_node=2", "--device cpu"):
        assert words in line, line
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=4,5"):
        select_device(0, "cuda", local_world_size=4)
    assert fake.chosen == []


def test_no_visible_gpu_with_device_cuda_is_one_line(monkeypatch):
    _fake_gpus(monkeypatch, 0, visible_devices="")
    env = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    with pytest.raises(ConfigError, match=r"--device cuda: no cuda device is visible to this process \(CUDA_VISIBLE_DEVICES=\)"):
        _check(env, "--device", "cuda")


def test_device_cpu_runs_gloo_on_a_gpu_machine(one_gpu):
    env = LaunchEnv(rank=0, world_size=8, local_rank=3, local_world_size=8)
    cfg, _, _ = _check(env, "--device", "cpu")
    assert cfg.device == "cpu"
    device = select_device(env.local_rank, cfg.device, local_world_size=8)
    assert device == torch.device("cpu") and one_gpu.chosen == []
    assert device_module.backend_for(device) == "gloo"


def test_the_cpu_is_never_short_of_devices():
    assert device_assignment_error("cpu", local_world_size=64, visible=0, environ={}) is None
    assert device_assignment_error("cuda", local_world_size=8, visible=8, environ={}) is None
    assert device_index(5, visible=8) == 5 and device_index(5, visible=1) == 0


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
