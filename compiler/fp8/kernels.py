"""FP8 products on torch's scaled GEMM (``torch._scaled_mm``, through compiler/torch_compat.py) where the running
torch and device have the recipe's kernel; ``None`` where not, and the recipe emulates (recipe.py).

What a build runs is not read from version numbers: the first product of each kind (device, scaling, operand
formats, output dtype) is probed once on a small random case and kept only if it ran AND agreed with the
emulation to within 1/64 of the output's magnitude (rounding differs, recipe.py; a misread scale layout is off by
O(1)). So a kernel that raises ("Invalid scaling configuration" on this CPU for blocks) or that would read scales
in another layout falls back to the emulation instead of training on wrong numbers.

Layouts (torch's requirements, written once for CPU and CUDA): the left operand row-major, the right one
column-major (CUDA's cuBLASLt needs it; the CPU kernel takes either). Scales: tensorwise 0-d; rowwise (M, 1) and
(1, N); blocks (pytorch test/test_matmul_cuda.py ``test_scaled_mm_vs_emulated_block_wise`` and ScaledBlas.cpp
``is_blockwise_1x128_scaling``): a 1x128 scale grid (M, K/128) column-major ("outer-dim-major"), a 128x128 right
operand's grid (K/128, N/128) column-major, a 128x1 right operand's grid (K/128, N) row-major.
"""

from __future__ import annotations

import torch

from compiler import torch_compat
from compiler.fp8.quantize import quantize_blocks
from compiler.fp8.tensor import Fp8Tensor

_PROBED: dict[tuple, bool] = {}
PROBE_SHAPE = (32, 256, 256)  # M, K, N: whole 128-blocks and multiples of 16, as every kernel needs


def scaled_product(a: Fp8Tensor, b: Fp8Tensor, kind: str, *, out_dtype: torch.dtype) -> torch.Tensor | None:
    """a (M, K) x b (K, N) -> (M, N) ``out_dtype`` on torch's kernel for scaling ``kind``, or None."""
    if not _operands_fit(a, b, kind) or not kernel_runs(a.data.device, kind, a_dtype=a.data.dtype, b_dtype=b.data.dtype,
                                                          out_dtype=out_dtype, right_block=_right_block(b)):
        return None
    return _call(a, b, kind, out_dtype)


def kernel_runs(device: torch.device, kind: str, *, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                right_block: str = "weight") -> bool:
    """Whether this device runs ``kind`` for these formats correctly (probed once per process and key)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return False
    key = (str(device), kind, a_dtype, b_dtype, out_dtype, right_block)
    if key not in _PROBED:
        _PROBED[key] = _probe(device, kind, a_dtype, b_dtype, out_dtype, right_block)
    return _PROBED[key]


def _right_block(b: Fp8Tensor) -> str:
    """A blockwise right operand is a weight's 128x128 blocks or an activation's 128x1 tiles (the weight gradient)."""
    return "tiles" if b.block == (128, 1) else "weight"


def _operands_fit(a: Fp8Tensor, b: Fp8Tensor, kind: str) -> bool:
    (m, k), n = a.shape, b.shape[1]
    device = a.data.device
    if device.type == "cuda" and (k % 16 or n % 16):  # cuBLASLt: leading dimensions of 16 bytes
        return False
    if min(m, k, n) == 0:
        return False
    if kind == "tensorwise":
        return a.scale.numel() == 1 and b.scale.numel() == 1
    if kind == "rowwise":
        return a.block == (1, k) and b.block == (k, 1)
    return kind == "blockwise" and a.block == (1, 128) and b.block in ((128, 128), (128, 1))


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return _row_major(t.t()).t()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Row-major strides in every dimension, size-1 ones included: ``contiguous()`` keeps a transposed (N, 1)
    scale's stride N on its unit dimension, which ``_scaled_mm`` checks (\"expected scale_a.stride(1) to be 1\")."""
    return t.contiguous().reshape(-1).view(t.shape)


def _call(a: Fp8Tensor, b: Fp8Tensor, kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    if kind == "tensorwise":
        scale_a, scale_b = a.scale.reshape(()), b.scale.reshape(())
    elif kind == "rowwise":
        scale_a, scale_b = _row_major(a.scale), _row_major(b.scale)  # (M, 1), (1, N)
    else:
        scale_a = _column_major(a.scale)  # (M, K/128)
        scale_b = _column_major(b.scale) if b.block == (128, 128) else _row_major(b.scale)
    return torch_compat.scaled_mm(a.data.contiguous(), _column_major(b.data), scale_a, scale_b, out_dtype=out_dtype)


PROBE_BLOCKS = {  # kind -> (left block, right block by right_block) over PROBE_SHAPE
    "tensorwise": ((32, 256), {"weight": (256, 256)}),
    "rowwise": ((1, 256), {"weight": (256, 1)}),
    "blockwise": ((1, 128), {"weight": (128, 128), "tiles": (128, 1)}),
}


def _probe(device: torch.device, kind: str, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
           right_block: str) -> bool:
    left, right = PROBE_BLOCKS[kind][0], PROBE_BLOCKS[kind][1].get(right_block)
    if right is None:
        return False
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)  # never the global generator: training draws from it
    with torch_compat.real_tensors(), torch.no_grad():
        # Rows and columns of different magnitudes, so that a misplaced scale shows.
        x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator)).to(device)
        w = (torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)).to(device)
        a = quantize_blocks(x, left, a_dtype)
        b = quantize_blocks(w.t(), right, b_dtype)
        try:
            out = _call(a, b, kind, out_dtype)
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            return False
        expected = a.dequantize() @ b.dequantize()
        if out.shape != expected.shape or out.dtype != out_dtype:
            return False
        return bool(((out.float() - expected).abs() <= expected.abs().max() / 64).all())
