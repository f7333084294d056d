"""MXFP4: OCP Microscaling FP4 (E2M1 elements, one E8M0 scale per block of 32), and gpt-oss's expert layout.

OCP Microscaling Formats (MX) Specification v1.0, sec. 5: an MX block is 32 elements sharing a scale X, element
i standing for X * P_i. MXFP4's elements are FP4 E2M1 (1 sign bit, 2 exponent bits with bias 1, 1 mantissa
bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or NaN); its scale is E8M0 (an unsigned byte s standing for
2^(s - 127), s = 255 is NaN, and a NaN scale makes the whole block NaN). The spec does not pack elements into
bytes; gpt-oss's checkpoints (and transformers' ``convert_moe_packed_tensors``) put element 2j in the low
nibble of byte j and element 2j + 1 in the high nibble, a code's bit 3 being its sign and bits 0-2 the index of
its magnitude in the list above::

    blocks [..., n_blocks, 16] uint8, scales [..., n_blocks] uint8  ->  float32 [..., n_blocks * 32]

Quantizing. Sec. 6.3 converts with X = 2^(floor(log2(amax)) - 2) and saturates elements above 6; the released
checkpoints' generator instead takes the smallest X = 2^e with amax / X <= 6, e = ceil(log2(amax / 6)), so
nothing saturates (clamped to E8M0's exponents, -127..127), then each element to its nearest code, a tie going
to the smaller magnitude, and a value that rounds to 0 to +0 (code 0, never -0). An all-zero block takes
e = -127 (byte 0): the formula's limit as amax -> 0 (triton_kernels' round-up of amax / 6 to a power of two,
done on the float32 bits, gives the same byte for 0); its codes are 0 at any scale, so it reads back as zeros
and quantizes again to the same bytes.

One choice beyond that formula: the same values can have two encodings. A block whose values are exactly
c * 2^e with every |c| <= 3 is also exactly 2c * 2^(e - 1); the formula picks e - 1 (largest code 6), yet
the generator, rounding weights down to a largest code of 3 (amax / 2^e in (3, 3.5]), stores about a quarter
of its blocks at e. So when a block's values are exact at the formula's exponent + 1 with largest code 3,
``quantize`` stores them there: reading a released file and quantizing the values again gives its bytes back,
and weights that were not already on the grid get exactly the formula's encoding (tests compare both with
tests/fixtures/hf-models/gpt-oss-mxfp4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # elements per scale (MX spec: k = 32)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code bits 0-2 -> magnitude
E2M1_MAX = 6.0
E8M0_BIAS, E8M0_NAN = 127, 255
MIN_EXPONENT, MAX_EXPONENT = -127, 127  # the finite E8M0 scales: bytes 0..254
# Halfway between consecutive magnitudes: a magnitude's code is how many of these lie strictly below it, so an
# exact tie goes to the smaller one and everything above 5 to 6 (saturation).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # code 0..15 -> value
# byte -> (value of its low nibble, value of its high nibble): elements 2j and 2j + 1 of a block.
_BYTE_PAIRS = tuple((_SIGNED[b & 0x0F], _SIGNED[b >> 4]) for b in range(256))
# quantize works through this many elements at a time: its float64 temporaries stay near 100 MB per chunk
# whatever the tensor (gpt-oss-120b's experts are 2.1 G elements per layer and tensor).
_CHUNK_ELEMENTS = 1 << 21


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) exactly, as float32: s in 1..254 is the float32 whose exponent field is s; s = 0 is the
    subnormal 2^-127; s = 255 is NaN."""
    s = scales.to(torch.int32)
    normal = (s << 23).view(torch.float32)
    out = torch.where(s == 0, torch.tensor(2.0 ** MIN_EXPONENT, dtype=torch.float32), normal)
    return torch.where(s == E8M0_NAN, torch.tensor(float("nan")), out)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., n_blocks * 32] from packed codes [..., n_blocks, 16] and E8M0 scales [..., n_blocks]."""
    _check_pair(blocks, scales)
    # A table lookup per byte, indexed by int32 (an int64 index per element would take twice the output's memory).
    pairs = F.embedding(blocks.int(), torch.tensor(_BYTE_PAIRS, dtype=torch.float32))  # [..., n_blocks, 16, 2]
    values = pairs.flatten(-2)  # [..., n_blocks, 32]
    values *= e8m0_to_float32(scales).unsqueeze(-1)  # exact: at most 2 significant bits times a power of two
    return values.flatten(-2)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes [..., K / 32] for x [..., K]: e = ceil(log2(amax / 6)) per block, computed exactly (the smallest
    e with amax <= 6 * 2^e), clamped to -127..127 (-127 for an all-zero block), plus the exact-block rule of the
    module docstring; stored as e + 127."""
    return (_exponents(_blocked(x)) + E8M0_BIAS).to(torch.uint8)


def encode(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., K / 32, 16] of x [..., K] at the given E8M0 scales [..., K / 32]: each element the
    nearest code to x / 2^(s - 127) (ties to the smaller magnitude; beyond 6 saturates to +-6; +0 for zero)."""
    blocked = _blocked(x)
    if tuple(scales.shape) != tuple(blocked.shape[:-1]) or scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8 {list(blocked.shape[:-1])} for x of shape {list(x.shape)}, got "
                         f"{scales.dtype} {list(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("scales hold the E8M0 NaN (255): no finite value is encoded at that scale")
    return _packed(_codes(blocked, scales.long() - E8M0_BIAS))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]) of a float x [..., K], K a multiple of 32;
    a chunk of dim 0 at a time."""
    step = max(1, _CHUNK_ELEMENTS // max(1, x[0].numel())) if x.dim() > 1 else 1
    blocks, scales = [], []
    for chunk in x.split(step) if x.dim() > 1 else (x,):
        blocked = _blocked(chunk)  # [..., n_blocks, 32] float64
        e = _exponents(blocked)
        blocks.append(_packed(_codes(blocked, e)))
        scales.append((e + E8M0_BIAS).to(torch.uint8))
    return torch.cat(blocks), torch.cat(scales)


# --- gpt-oss's experts --------------------------------------------------------------------------------------

def pack_experts(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's released layout of an expert parameter [E, in, out] (x @ W per expert): transposed to
    [E, out, in] so that each block is 32 consecutive inputs of one output, then quantized:
    (blocks [E, out, in / 32, 16], scales [E, out, in / 32])."""
    if param.dim() != 3:
        raise ValueError(f"an expert parameter is [experts, in, out], got shape {list(param.shape)}")
    return quantize(param.transpose(1, 2))


def unpack_experts(blocks: torch.Tensor, scales: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Experts [start, stop) of the parameter [E, in, out] stored as blocks [E, out, in / 32, 16] and scales
    [E, out, in / 32]: only those experts' blocks and scales are sliced and read. float32, contiguous."""
    if blocks.dim() != 4:
        raise ValueError(f"expert blocks are [experts, out, in / 32, 16], got shape {list(blocks.shape)}")
    stop = blocks.shape[0] if stop is None else stop
    if not 0 <= start <= stop <= blocks.shape[0]:
        raise ValueError(f"experts [{start}, {stop}) are not within the {blocks.shape[0]} experts")
    return dequantize(blocks[start:stop], scales[start:stop]).transpose(1, 2).contiguous()  # [n, in, out]


# --- helpers ---------------------------------------------------------------------------------------------------

def _blocked(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as float64 [..., K / 32, 32] (exact for float32 and narrower inputs)."""
    if x.dim() == 0 or not x.dtype.is_floating_point or x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes floats [..., K] with K a multiple of {BLOCK}, got {x.dtype} of shape "
                         f"{list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"cannot quantize {int((~torch.isfinite(x)).sum())} non-finite values to MXFP4")
    return x.double().contiguous().unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))


def _exponents(blocked: torch.Tensor) -> torch.Tensor:
    """Block exponents e (int64) [..., n_blocks] of float64 blocks [..., n_blocks, 32] (block_scales' rule)."""
    amax = blocked.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)  # amax / 6 = m * 2^k, m in [0.5, 1)
    # ceil(log2(amax / 6)) up to the rounding of amax / 6 (beyond E8M0's range the answer is clamped anyway) ...
    e = (exponent.long() - (mantissa == 0.5).long()).clamp(MIN_EXPONENT - 1, MAX_EXPONENT + 1)
    e = e + (amax > E2M1_MAX * _pow2(e)).long()  # ... then exactly the smallest e with amax <= 6 * 2^e
    e = e - (amax <= E2M1_MAX * _pow2(e - 1)).long()
    e = torch.where(amax > 0, e, MIN_EXPONENT).clamp(MIN_EXPONENT, MAX_EXPONENT)
    # The exact-block rule, checked only where amax is exactly 6 * 2^e (rare in weights not already on the grid).
    candidates = (amax == E2M1_MAX * _pow2(e)) & (e < MAX_EXPONENT)
    if bool(candidates.any()):
        up, values = e[candidates] + 1, blocked[candidates]  # [n], [n, 32]
        exact = (_decode(_codes(values, up), up) == values).all(-1)
        e[candidates] = torch.where(exact, up, e[candidates])
    return e


def _packed(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n_blocks, 32] -> bytes [..., n_blocks, 16]: element 2j in the low nibble of byte j."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, exactly, for integer e in -1022..1023: the float64 whose exponent field is e + 1023."""
    return ((e.clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


def _codes(blocked: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., n_blocks, 32] (int64) of float64 values at block exponents e [..., n_blocks]."""
    scaled = blocked * _pow2(-e).unsqueeze(-1)  # exact: a power of two within float64's range
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(_MIDPOINTS, dtype=torch.float64), right=False)
    negative = (scaled < 0) & (magnitude > 0)  # a value rounding to 0 is +0
    return magnitude | (negative.long() << 3)


def _decode(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_SIGNED, dtype=torch.float64)[codes] * _pow2(e).unsqueeze(-1)


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks are uint8 [..., n_blocks, {BLOCK // 2}], got {blocks.dtype} of shape "
                         f"{list(blocks.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 scales must be uint8 {list(blocks.shape[:-1])} for blocks of shape "
                         f"{list(blocks.shape)}, got {scales.dtype} {list(scales.shape)}")
