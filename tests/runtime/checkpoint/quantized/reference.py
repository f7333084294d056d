"""Elementwise references for the quantized formats, written from their definitions with Python floats and
loops (slow and obvious; a few blocks at a time), for the codec, folder and export tests.

- e4m3 (OCP 8-bit floating point spec): S.EEEE.MMM, bias 7, exponent 0 subnormal, S.1111.111 NaN; DeepSeek-V3's
  block FP8: w[r, c] = code * scale_inv[r // b0, c // b1], scale_inv = amax / 448 (0 -> 1).
- MXFP4 (OCP MX spec v1.0 sec. 5): E2M1 codes S.EE.M (bias 1), E8M0 scales 2^(s - 127) (255 NaN), blocks of 32;
  element 2j in byte j's low nibble (gpt-oss's packing).
"""

from __future__ import annotations

import math
import struct


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_value(byte: int) -> float:
    """S.EEEE.MMM, exponent bias 7; exponent 0 is subnormal (M/8 * 2^-6); S.1111.111 is NaN; no infinities."""
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 15, byte & 7
    if exponent == 15 and mantissa == 7:
        return math.nan
    magnitude = mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if sign else magnitude


E4M3 = sorted((e4m3_value(b), b) for b in range(128) if not math.isnan(e4m3_value(b)))  # (value, byte), >= 0


def e4m3_nearest(v: float) -> int:
    """The byte of the e4m3 value nearest v; a tie to the even code (mantissa bit 0 clear); beyond 448: 448."""
    magnitude = min(abs(v), 448.0)
    best = min(E4M3, key=lambda vb: (abs(vb[0] - magnitude), vb[1] & 1))[1]
    return best | (0x80 if math.copysign(1, v) < 0 else 0)


def fp8_reference_dequantize(codes: list[list[int]], scales: list[list[float]], block) -> list[list[float]]:
    return [[f32(e4m3_value(b) * scales[r // block[0]][c // block[1]]) for c, b in enumerate(row)]
            for r, row in enumerate(codes)]


def fp8_reference_quantize(w: list[list[float]], block) -> tuple[list[list[int]], list[list[float]]]:
    rows, cols = len(w), len(w[0])
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = [[0.0] * grid[1] for _ in range(grid[0])]
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = max(abs(w[r][c]) for r in range(i * block[0], min(rows, (i + 1) * block[0]))
                       for c in range(j * block[1], min(cols, (j + 1) * block[1])))
            scales[i][j] = f32(amax / 448) if amax > 0 else 1.0
    codes = [[e4m3_nearest(f32(w[r][c] / scales[r // block[0]][c // block[1]])) for c in range(cols)]
             for r in range(rows)]
    return codes, scales


def e2m1_value(code: int) -> float:
    """S.EE.M, exponent bias 1; exponent 0 is subnormal (M * 0.5); no inf or NaN."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


MAGNITUDES = [e2m1_value(c) for c in range(8)]


def e8m0_value(s: int) -> float:
    return float("nan") if s == 255 else 2.0 ** (s - 127)


def mx_reference_dequantize(blocks: list, scales: list) -> list:
    """One row: blocks [n, 16] bytes, scales [n] -> 32 n values."""
    out = []
    for block, s in zip(blocks, scales):
        for byte in block:
            out += [e2m1_value(byte & 15) * e8m0_value(s), e2m1_value(byte >> 4) * e8m0_value(s)]
    return out


def nearest_code(v: float) -> int:
    """Nearest magnitude (beyond 6: 6), a tie to the smaller one; the sign bit only on a non-zero magnitude."""
    index = min(range(8), key=lambda i: (abs(abs(v) - MAGNITUDES[i]), i))
    return index | (8 if v < 0 and index > 0 else 0)


def mx_reference_quantize(row: list) -> tuple[list, list]:
    """One row of 32 n floats -> (blocks [n, 16], scales [n])."""
    blocks, scales = [], []
    for b in range(0, len(row), 32):
        values = row[b:b + 32]
        amax, e = max(abs(v) for v in values), -127
        while amax > 6 * 2.0 ** e and e < 127:
            e += 1  # the smallest e with amax <= 6 * 2^e: ceil(log2(amax / 6)), -127 for zeros
        exact_above = all(abs(v / 2.0 ** (e + 1)) in MAGNITUDES for v in values)
        if amax == 6 * 2.0 ** e and exact_above and e < 127:
            e += 1  # the same values with largest code 3 (the module's exact-block rule)
        codes = [nearest_code(v / 2.0 ** e) for v in values]
        blocks.append([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)])
        scales.append(e + 127)
    return blocks, scales
