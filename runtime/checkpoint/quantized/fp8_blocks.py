"""DeepSeek-V3's block FP8 weights: float8_e4m3fn codes and one float32 scale per block of b0 x b1 elements.

DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.3.2, fine-grained quantization: a weight is scaled per
128 x 128 block by the block's largest magnitude, so an outlier costs precision in its own block only. The
released checkpoint stores each such weight [R, C] as float8_e4m3fn beside a float32 ``weight_scale_inv`` of
shape [ceil(R / b0), ceil(C / b1)]; its ``inference/kernel.py`` ``weight_dequant`` reads (edge blocks may be
partial: the kernel masks rows >= R and columns >= C)::

    w[r, c] = float32(w_fp8[r, c]) * scale_inv[r // b0, c // b1]

``quantize`` is the inverse the release implies, and the recipe of that file's ``act_quant`` (which does it
for activations, per 1 x 128 tile): scale_inv = amax(|block|) / 448 in float32 (448: the largest finite
e4m3fn value, OCP 8-bit floating point spec, "E4M3"), codes = w / scale_inv rounded to the nearest e4m3
(ties to even: torch's cast). Reading the codes back and quantizing again gives the same bytes: fl(amax / 448)
is always recovered from fl(448 * scale_inv) (tests/runtime/checkpoint/quantized/test_fp8_blocks.py checks
every float32 mantissa).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn (S.1111.110); S.1111.111 is NaN
# An all-zero block has amax 0, so amax / 448 would make every code 0 / 0. Its codes are zeros whatever the
# scale, and scale 1 keeps them exact both ways (never a NaN or inf scale in the file, and dequantize ->
# quantize gives the same bytes); a block so small that amax / 448 underflows to 0 takes it too (its codes
# round to 0, an error below 448 * 2**-149).
ZERO_BLOCK_SCALE = 1.0


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [R, C] weight: [ceil(R / b0), ceil(C / b1)], the last row / column of blocks partial."""
    (rows, cols), (b0, b1) = shape, block
    return -(-rows // b0), -(-cols // b1)


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"block size must be two positive integers (rows, columns), got {list(block)}")
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [R, C] from float8_e4m3fn codes [R, C] and scale_inv [ceil(R / b0), ceil(C / b1)]."""
    return dequantize_rows(weight, scale_inv, block, 0, weight.shape[0] if weight.dim() == 2 else 0)


def dequantize_rows(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                    start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of ``dequantize(weight, scale_inv, block)``, float32 [stop - start, C]. Only those rows
    of ``weight`` and the scale rows they need (start // b0 up to ceil(stop / b0)) are sliced and read, so on a
    memory-mapped file the other rows' pages are never touched."""
    b0, b1 = check_block(block)
    _check_pair(weight, scale_inv, (b0, b1))
    rows, cols = weight.shape
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) are not within the weight's {rows} rows")
    first = start // b0
    scales = scale_inv[first:-(-stop // b0)].float()  # [scale rows needed, ceil(C / b1)]
    # Each row's scales: block row (r // b0) for r in [start, stop), as weight_dequant's pid_m.
    row_scales = scales.repeat_interleave(b0, dim=0)[start - first * b0:stop - first * b0]  # [n, ceil(C / b1)]
    out = weight[start:stop].float()  # [n, C]: the one full-size temporary
    whole = cols // b1 * b1
    out[:, :whole].view(stop - start, cols // b1, b1).mul_(row_scales[:, :cols // b1, None])
    if whole < cols:  # the partial last block column
        out[:, whole:].mul_(row_scales[:, -1:])
    return out


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """scale_inv [ceil(R / b0), ceil(C / b1)] float32: each block's amax / 448 (ZERO_BLOCK_SCALE where that is 0)."""
    b0, b1 = check_block(block)
    w = _float32_matrix(w)
    rows, cols = w.shape
    grid = grid_shape((rows, cols), (b0, b1))
    padded = w.new_zeros(grid[0] * b0, grid[1] * b1)  # zeros change no block's amax
    padded[:rows, :cols] = w.abs()
    amax = padded.view(grid[0], b0, grid[1], b1).amax(dim=(1, 3))
    scale = amax / E4M3_MAX  # float32, as act_quant's `tl.max(tl.abs(x)) / 448.`
    return torch.where(scale > 0, scale, torch.full_like(scale, ZERO_BLOCK_SCALE))


def encode(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn codes [R, C] = w / scale_inv of its block, rounded to the nearest e4m3 (ties to even) in
    float32. Values beyond +-448 * scale saturate to +-448, clamped here rather than left to the cast (the OCP
    8-bit FP spec leaves overflow to the conversion: a cast that does not saturate gives NaN, e4m3fn's only
    value past 448)."""
    b0, b1 = check_block(block)
    w = _float32_matrix(w)
    rows, cols = w.shape
    if tuple(scale_inv.shape) != grid_shape((rows, cols), (b0, b1)):
        raise ValueError(f"scale_inv has shape {list(scale_inv.shape)}, a [{rows}, {cols}] weight in blocks of "
                         f"{[b0, b1]} needs {list(grid_shape((rows, cols), (b0, b1)))}")
    full = scale_inv.float().repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return (w / full).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes [R, C], float32 scale_inv [ceil(R / b0), ceil(C / b1)]) of a float [R, C] weight."""
    scale_inv = block_scales(w, block)
    return encode(w, scale_inv, block), scale_inv


def _float32_matrix(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"block FP8 quantizes a floating-point matrix [R, C], got {w.dtype} of shape {list(w.shape)}")
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"cannot quantize a weight holding {int((~torch.isfinite(w)).sum())} non-finite values")
    return w


def _check_pair(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block FP8 weights are float8_e4m3fn [R, C], got {weight.dtype} of shape {list(weight.shape)}")
    grid = grid_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale_inv has shape {list(scale_inv.shape)}, a {list(weight.shape)} weight in blocks of "
                         f"{list(block)} needs {list(grid)}")
    if not scale_inv.dtype.is_floating_point:
        raise ValueError(f"scale_inv must be floating point, got {scale_inv.dtype}")
