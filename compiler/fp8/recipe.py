"""An FP8 training recipe: a row of facts (formats, block layouts, scale rounding, the kernel it maps to) and the
three functions every caller uses: ``quantize``, ``dequantize`` and ``matmul``. The rows live in recipes/.

Layouts are data: for each role (tensor.py) a block (rows, cols) where ``FULL`` is the whole dimension. A dimension
whose block is ``FULL`` has one scale along all of it, so when a rank holds only a shard of the tensor along that
dimension the shards' amaxes must be reduced (MAX) before scaling for the FP8 bytes to be those of the whole
tensor; along a dimension of fixed-size blocks nothing is shared, provided each shard is a whole number of blocks.

``matmul(a, b, out_dtype)``: a (M, K) and b (K, N) quantized along K (a on axis 1, b on axis 0) -> (M, N) in
``out_dtype``: torch's scaled GEMM where the running torch and device have the recipe's kernel (kernels.py), else
the emulation, which is exact in this sense: it dequantizes both operands (each FP8 value, exact in float32, times
its block's float32 scale, rounded once) and multiplies in float32, i.e. it evaluates the recipe's defined
product sum_k deq(a)_ik deq(b)_kj with float32 arithmetic. A device kernel forms the same sum from the same FP8
values and scales but in another order: the tensorwise and rowwise kernels accumulate sum_k a_ik b_kj in float32
and multiply by scale_a_i scale_b_j once; DeepSeek-V3's blockwise GEMM multiplies each 128-wide K chunk's float32
partial sum by its two scales (sec. 3.3.2, "increasing accumulation precision"). So the two agree within float32
rounding (gamma_K sum_k |a_ik b_kj| plus a few ulps for the scales) and one rounding to ``out_dtype``; neither is
bit-identical to the other. ``use_fast_accum`` (Hopper's reduced-precision FP8 accumulation) is never asked for.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Mapping

import torch

from compiler.fp8.guard import AmaxGuard
from compiler.fp8.kernels import scaled_product
from compiler.fp8.quantize import AmaxReduce, quantize_blocks
from compiler.fp8.tensor import ROLES, Fp8Tensor, Role

FULL = None  # a block dimension spanning the whole tensor dimension
Block = tuple[int | None, int | None]


@dataclass(frozen=True)
class Recipe:
    name: str  # the --fp8 choice
    description: str
    source: str  # where the recipe is defined
    dtypes: Mapping[str, torch.dtype]  # FP8 format per operand kind (tensor.py INPUT, WEIGHT, GRAD_OUTPUT)
    blocks: Mapping[Role, Block]  # block per role; FULL: the whole dimension
    power_of_two: bool  # scales rounded to powers of two (quantize.py)
    kernel: str  # torch's scaled-GEMM scaling this recipe maps to: "tensorwise", "rowwise" or "blockwise"

    def __post_init__(self) -> None:
        assert set(self.blocks) == set(ROLES), f"{self.name}: a block for every role"

    def block(self, role: Role, shape: tuple[int, int]) -> tuple[int, int]:
        """The (br, bc) block of a (R, C) operand in ``role``."""
        return tuple(max(n, 1) if b is FULL else b for b, n in zip(self.blocks[role], shape))

    def shards_share_scales(self, role: Role, dim: int) -> bool:
        """Whether shards of an operand along ``dim`` must reduce their amaxes (MAX) to scale as the whole would."""
        return self.blocks[role][dim] is FULL

    def check_shard(self, role: Role, dim: int, local_size: int) -> None:
        """ValueError unless a shard of ``local_size`` along ``dim`` holds whole blocks (fixed-size blocks only
        stay local to a shard when its edges are block edges)."""
        size = self.blocks[role][dim]
        if size is not FULL and local_size % size:
            raise ValueError(f"--fp8 {self.name}: a shard of {local_size} along dimension {dim} of a {role.kind} "
                             f"splits its {size}-wide scaling blocks; shard sizes must be multiples of {size}")

    def quantize(self, t: torch.Tensor, role: Role, *, amax_reduce: AmaxReduce | None = None,
                 guard: AmaxGuard | None = None) -> Fp8Tensor:
        """(R, C) -> FP8 values and scales in this recipe's layout for ``role``; ``amax_reduce`` (MAX over the ranks
        holding other shards, when ``shards_share_scales``) sees the local block amaxes before scales are formed."""
        return quantize_blocks(t, self.block(role, tuple(t.shape)), self.dtypes[role.kind],
                               power_of_two=self.power_of_two, amax_reduce=amax_reduce, guard=guard)

    def dequantize(self, q: Fp8Tensor) -> torch.Tensor:
        return q.dequantize()

    def matmul(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """(M, K) x (K, N) -> (M, N) in ``out_dtype`` (module docstring)."""
        out = scaled_product(a, b, self.kernel, out_dtype=out_dtype)
        return emulated_matmul(a, b, out_dtype) if out is None else out


def emulated_matmul(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The recipe's product in float32 from the dequantized operands, autocast off (it must not run in bf16)."""
    with autocast_off(a.data.device.type):
        return (a.dequantize() @ b.dequantize()).to(out_dtype)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matrix products in on ``device_type`` now, or None when it is off."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    if autocast_dtype(device_type) is not None:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
