"""Dynamic scaling, block by block: amax -> scale -> saturated FP8 values, the one quantizer every recipe uses.

For a (R, C) tensor cut into (br, bc) blocks (tensor.py): each block's amax = max |x| over its elements (a partial
edge block over the elements it has); ``amax_reduce`` may then combine it with other ranks' amaxes of the same
block (the tensor is a shard of a larger one: see ``compiler/fp8/README.md``); its scale, float32, is

    scale = amax / fp8_max                                         (torchao "tensorwise", DeepSeek-V3 sec. 3.3.2)
    scale = 1 / 2^floor(log2(fp8_max / amax))                      (power_of_two: torchao round_scales_to_power_of_2)

and each value becomes saturate(x * (1 / scale)) cast to FP8, rounding to nearest, ties to even. fp8_max is 448
for e4m3 and 57344 for e5m2. The power-of-two form rounds torchao's multiplier fp8_max / amax down to a power of
two (torchao float8_utils.py ``_round_scale_down_to_power_of_2``), so the scale is a power of two at least
amax / fp8_max: multiplying and dividing by it is exact. Here the power is taken exactly with ``frexp``; torchao's
``exp2(floor(log2(m)))`` agrees except where float32 ``log2`` rounds a multiplier just under a power of two up to
it, which doubles torchao's multiplier and saturates the block's largest values.

Saturation is explicit (clamp to +-fp8_max, then cast), as torchao's ``to_fp8_saturated``: torch's own cast did
not saturate finite overflows in eager mode up to 2.11 (torchao's note there; older c10 code gave e4m3fn NaN at
|x| >= 480), 2.12+ saturates e4m3fn (even inf -> 448) but sends e5m2 overflow to inf. With the clamp the result
is the same on every version. NaN stays NaN.

A zero block: amax is floored at 1e-12 (torchao's EPS), so its scale is finite and its values stay 0.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from compiler.fp8.guard import AmaxGuard
from compiler.fp8.tensor import FP8_MAX, Fp8Tensor, element_scale, grid_shape

AMAX_FLOOR = 1e-12
AmaxReduce = Callable[[torch.Tensor], torch.Tensor]


def block_amax(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(R, C) -> (ceil(R / br), ceil(C / bc)) float32: max |x| per block; NaN if the block has one."""
    (rows, cols), (br, bc) = t.shape, block
    gr, gc = grid_shape((rows, cols), block)
    magnitude = t.abs()
    if (gr * br, gc * bc) != (rows, cols):  # partial edge blocks: zeros never raise an amax
        magnitude = F.pad(magnitude, (0, gc * bc - cols, 0, gr * br - rows))
    return magnitude.reshape(gr, br, gc, bc).amax(dim=(1, 3)).float()


def scales_from_amax(amax: torch.Tensor, fp8_max: float, *, power_of_two: bool) -> torch.Tensor:
    """Float32 dequantization scales (module docstring). Inf or NaN amaxes give inf or NaN scales."""
    amax = amax.float().clamp(min=AMAX_FLOOR)
    if not power_of_two:
        return amax / fp8_max
    multiplier = fp8_max / amax
    _, exponent = torch.frexp(multiplier)  # multiplier = m 2^e, 0.5 <= m < 1, so 2^(e-1) <= multiplier < 2^e
    floor = torch.ldexp(torch.ones_like(multiplier), exponent - 1)
    floor = torch.where(torch.isfinite(multiplier) & (multiplier > 0), floor, multiplier)
    return 1.0 / floor


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to the format's finite range, then cast (round to nearest, ties to even)."""
    limit = FP8_MAX[dtype]
    return x.clamp(-limit, limit).to(dtype)


def quantize_blocks(t: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *, power_of_two: bool = False,
                    amax_reduce: AmaxReduce | None = None, guard: AmaxGuard | None = None) -> Fp8Tensor:
    """(R, C) high-precision tensor -> its FP8 values and block scales. ``amax_reduce`` receives the local block
    amaxes (the scale grid's shape) and returns the ones to scale by; ``guard`` records whether any was inf or NaN."""
    if t.dim() != 2:
        raise ValueError(f"FP8 quantization takes a 2-D tensor, got shape {tuple(t.shape)}")
    amax = block_amax(t, block)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    if guard is not None:
        guard.observe(amax)
    scale = scales_from_amax(amax, FP8_MAX[dtype], power_of_two=power_of_two)
    inverse = element_scale(scale.reciprocal(), tuple(t.shape), block)
    return Fp8Tensor(saturating_cast(t.float() * inverse, dtype), scale, block)
