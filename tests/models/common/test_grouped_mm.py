"""models/common/grouped_mm.py: the experts' grouped product registers torch's grouped GEMM as its CUDA kernel
itself, on import (a model used without the engine is as fast), and that kernel's masking of what the GEMM leaves
unwritten (rows past the last offset, experts without rows) gives the loop's zeros. The GEMM's own numbers on a
GPU: tests/gpu/test_moe_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.common import grouped_mm as gm
from tests.paths import ROOT


def test_importing_the_models_registers_the_cuda_kernels_without_the_engine():
    probe = ("import sys, torch, models\n"
             "print([torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for op in "
             "('moe::grouped_mm', 'moe::grouped_mm_weight_grad') for key in ('CUDA', 'CPU')])\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('compiler', 'runtime')))\n")
    lines = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    registered, engine = lines.splitlines()
    # CUDA has its own kernel (torch's grouped GEMM); the CPU keeps the operator's default, the loop.
    assert registered == str([True, False, True, False])
    assert engine == "[]"


def test_the_grouped_gemm_applies_on_cuda_in_bf16_only():
    x, w = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    assert not gm.grouped_gemm_applies(x, w, 8, 8)  # the CPU runs the loop, as before


def _unwritten_as_nan(grouped_mm):
    """torch's grouped GEMM with what its contract leaves undefined set to NaN: the rows past the last offset
    (2-D x 3-D) and the blocks of groups without rows (2-D x 2-D). On this CPU torch leaves the rows unwritten
    but writes zeros for empty groups; on an H100 (2.11) the same, with no contract saying so."""
    def run(a, b, *, offs):
        out = grouped_mm(a, b, offs=offs).clone()
        if b.dim() == 3:
            out[int(offs[-1]):] = float("nan")
        else:
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out
    return run


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no public grouped GEMM")
def test_the_cuda_kernels_give_the_loops_zeros_where_the_gemm_writes_nothing(monkeypatch):
    # torch's grouped GEMM runs on this CPU too (a loop of its own): the CUDA kernels' code, on CPU tensors.
    monkeypatch.setattr(gm, "grouped_gemm_applies", lambda *_: True)
    monkeypatch.setattr(F, "grouped_mm", _unwritten_as_nan(F.grouped_mm))
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([10, 0, 15, 7, 0])  # empty experts; 8 padding rows after the 32
    offsets = counts.cumsum(0, dtype=torch.int32)
    x, w, grad = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((40, 16), (5, 8, 16), (40, 8)))
    out = gm.grouped_mm_cuda(x, w, offsets)
    assert out[32:].eq(0).all()
    torch.testing.assert_close(out, gm.grouped_mm_by_expert(x, w, offsets), rtol=2e-2, atol=2e-2)
    weight_grad = gm.weight_grad_cuda(grad, x, offsets, 5)
    assert weight_grad[1].eq(0).all() and weight_grad[4].eq(0).all()
    torch.testing.assert_close(weight_grad, gm.weight_grad_by_expert(grad, x, offsets, 5), rtol=2e-2, atol=2e-2)
