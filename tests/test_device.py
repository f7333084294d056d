"""runtime/device.py: the CPU heap setting behind --compact-cpu-memory."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


def _resident_after_free(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_compact_heap_returns_freed_tensors_to_the_kernel():
    assert _resident_after_free("default") > 200  # glibc's heap keeps the freed blocks resident
    assert _resident_after_free("compact") < 20  # only the one kept tensor (5 MiB) stays


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
