"""FP8 quantization written from the definitions, one element at a time in Python floats, for the tests to compare
the recipes with. Nothing here calls torch's FP8 casts or compiler/fp8.

Float32 arithmetic: Python floats are IEEE doubles; one +, -, x or / of float32 values computed in double and then
rounded to float32 equals the float32 operation (double has 53 >= 2 x 24 + 2 bits, so the double rounding is
innocuous), so ``f32(a / b)`` is the float32 quotient.
"""

from __future__ import annotations

import math
import struct

import torch

# mantissa bits, smallest normal exponent, largest finite value (OCP 8-bit floating point spec)
FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}
AMAX_FLOOR = 1e-12


def f32(v: float) -> float:
    """Round a double to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def round_fp8(v: float, dtype: torch.dtype) -> float:
    """Round to the nearest value of the format, ties to even, saturating at its largest finite value."""
    mantissa_bits, min_exponent, largest = FORMATS[dtype]
    if math.isnan(v):
        return v
    if abs(v) >= largest:
        return math.copysign(largest, v)
    exponent = math.frexp(v)[1] - 1 if v else min_exponent  # |v| = m 2^exponent, 1 <= m < 2
    step = 2.0 ** (max(exponent, min_exponent) - mantissa_bits)  # the spacing of the format at |v| (subnormals: fixed)
    q = round(v / step) * step  # Python's round: to nearest, ties to even
    return math.copysign(min(abs(q), largest), v)


def scale_from_amax(amax: float, dtype: torch.dtype, *, power_of_two: bool) -> float:
    largest = FORMATS[dtype][2]
    amax = max(amax, f32(AMAX_FLOOR))
    if not power_of_two:
        return f32(amax / largest)
    multiplier = f32(largest / amax)
    return 1.0 / 2.0 ** (math.frexp(multiplier)[1] - 1)  # 1 / (the largest power of two <= multiplier)


def quantize_reference(t: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                       power_of_two: bool) -> tuple[list[list[float]], list[list[float]]]:
    """(FP8 values as floats, scales) of a 2-D float32 tensor cut into ``block``s (partial edge blocks)."""
    values = t.tolist()
    rows, cols = len(values), len(values[0])
    br, bc = block
    grid_rows, grid_cols = -(-rows // br), -(-cols // bc)
    scales = [[0.0] * grid_cols for _ in range(grid_rows)]
    out = [[0.0] * cols for _ in range(rows)]
    for gi in range(grid_rows):
        for gj in range(grid_cols):
            cells = [(i, j) for i in range(gi * br, min(rows, gi * br + br)) for j in range(gj * bc, min(cols, gj * bc + bc))]
            scale = scale_from_amax(max(abs(values[i][j]) for i, j in cells), dtype, power_of_two=power_of_two)
            scales[gi][gj] = scale
            inverse = f32(1.0 / scale)
            for i, j in cells:
                out[i][j] = round_fp8(f32(values[i][j] * inverse), dtype)
    return out, scales


def element_error_bound(q_scale: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|dequantized - x| per element: rounding to nearest in a format with m mantissa bits errs by at most half a
    step, 2^-(m+1) |x| for normal values and 2^(emin - m - 1) in units of the scale below the normal range
    (e4m3: 2^-4 |x| or 2^-10 s; e5m2: 2^-3 |x| or 2^-17 s); plus a float32 ulp for the scale's rounding."""
    mantissa_bits, min_exponent, _ = FORMATS[dtype]
    relative = 2.0 ** -(mantissa_bits + 1)
    subnormal = 2.0 ** (min_exponent - mantissa_bits - 1)
    return (relative * x.abs() + subnormal * q_scale) * (1 + 2 ** -22)
