"""Rotary position embeddings (RoFormer, Su et al. 2021): plain, with Llama 3's frequency scaling, or with YaRN.

Convention: Hugging Face's "rotate half". Feature i of a head is paired with feature i + head_dim/2 and the
pair rotated by angle position * inv_freq[i]; Hugging Face's Llama checkpoints are stored for this
convention, so their q and k weights load unchanged. Meta's original checkpoints rotate adjacent features
(2i, 2i+1) instead; loading those would permute the rows of q and k within each head (Hugging Face's
convert_llama_weights_to_hf.py does exactly that), which Llama does not need. DeepSeek's checkpoints keep
adjacent pairs and transformers de-interleaves them at run time (``deinterleave``), as models/common/latent_attention.py does.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"; ``YaRN`` below) is one
implementation for every family whose config names it (DeepSeek-V3, gpt-oss): a function of its rope parameters only.

Nothing here creates a tensor on a device of its own (the model is traced on the meta device and the graph
must run anywhere): frequency indices and positions are derived from the input with ``*_like`` ops, and
results are cast with ``type_as`` (a traced ``.to(dtype)`` kept an assertion on the meta device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """m(s, x) = 0.1 x ln(s) + 1 for s > 1, else 1: YaRN's attention temperature (Peng et al. 2023, eq. 22, with
    x = 1; DeepSeek-V2's yarn_get_mscale names x mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN as transformers computes it (modeling_rope_utils._compute_yarn_parameters, transformers 5): the rope
    parameters of config.json's ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x) with ``rope_type`` "yarn".

    Frequencies: f_i = theta^(-2i/d) (d the rotated dimension) become f_i (1 - r_i) + (f_i / factor) r_i with the ramp
    r_i = clamp((i - low) / (high - low), 0, 1) over i = 0 .. d/2 - 1, where low and high are the dimensions whose
    wavelength turns ``beta_fast`` and ``beta_slow`` times in ``original_context`` positions,
    d ln(original_context / (2 pi beta)) / (2 ln theta), floored and ceiled when ``truncate`` (transformers' default;
    gpt-oss sets it false), clamped to [0, d - 1]. High frequencies (r = 0) are kept, low ones (r = 1) divided.
    cos and sin are multiplied by ``cos_sin_factor``."""

    factor: float
    original_context: int  # original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # given: the cos / sin multiplier itself
    truncate: bool = True

    def correction_range(self, dim: int, theta: float) -> tuple[float, float]:
        """(low, high) of the ramp for a rotated dimension ``dim`` and base ``theta``."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by: ``attention_factor`` when given; m(factor, mscale) /
        m(factor, mscale_all_dim) when both are set (non-zero); else m(factor, 1) (``yarn_mscale``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_factor(self) -> float:
        """m(factor, mscale_all_dim)^2, 1 without mscale_all_dim: what DeepSeek-V2 / V3 multiply their attention's
        softmax scale by (transformers' DeepseekV3Attention; gpt-oss multiplies by nothing)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class Rope:
    theta: float  # the base: inv_freq[i] = theta ** (-2i / head_dim)
    factor: float | None  # Llama 3 scaling factor; None: plain RoPE (or YaRN's, below)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    yarn: YaRN | None = None  # YaRN instead (``factor`` None)


def inverse_frequencies(q: torch.Tensor, rope: Rope) -> torch.Tensor:
    """(head_dim/2,) fp32 rotation rates for q of shape (B, T, H, head_dim).

    Plain RoPE: theta ** (-2i / head_dim), computed as Hugging Face does (1 / theta ** (2i / head_dim) in
    fp32). Llama 3 (Meta's llama/generation apply_scaling; transformers' llama3 rope type): rates whose
    wavelength 2 pi / rate is longer than original_context / low_freq_factor are divided by ``factor``
    (stretched to the long context), those shorter than original_context / high_freq_factor are kept (they
    resolve local order), and those in between are interpolated linearly in original_context / wavelength.
    """
    head_dim = q.shape[-1]
    index = torch.ones_like(q[0, 0, 0, : head_dim // 2], dtype=torch.float32).cumsum(0) - 1  # 0, 1, ..., hd/2 - 1
    if rope.yarn is not None:
        return _yarn_frequencies(index, rope.theta, rope.yarn)
    inv_freq = 1.0 / (rope.theta ** (2 * index / head_dim))
    if rope.factor is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = rope.original_context / rope.low_freq_factor  # longer: divided by the factor
    short_wavelength = rope.original_context / rope.high_freq_factor  # shorter: kept
    stretched = torch.where(wavelength > long_wavelength, inv_freq / rope.factor, inv_freq)
    # In the middle band, a weight going from 0 at long_wavelength to 1 at short_wavelength.
    weight = (rope.original_context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - weight) * stretched / rope.factor + weight * stretched
    middle = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(middle, blended, stretched)


def _yarn_frequencies(index: torch.Tensor, theta: float, yarn: YaRN) -> torch.Tensor:
    """YaRN's rates (``YaRN``) for the indices 0 .. d/2 - 1 (fp32), in transformers' order of operations."""
    dim = 2 * index.shape[0]
    low, high = yarn.correction_range(dim, theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((index - low) / (high - low)).clamp(0, 1)  # (d/2,): 0 keeps a rate, 1 divides it by the factor
    pos_freqs = theta ** (2 * index / dim)
    extrapolation = 1 - ramp
    return 1.0 / (yarn.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rotary_cos_sin(q: torch.Tensor, positions: torch.Tensor | None, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, feature) angle for q of shape (B, T, H, hd), in q's dtype, shaped to
    broadcast against it: (1, T, 1, hd) for positions 0..T-1 (``positions`` None), (B, T, 1, hd) for
    per-token ``positions`` (B, T) int64. Angles are computed in fp32 and cast after cos / sin, as Hugging
    Face does (bf16 angles would lose whole turns at positions in the thousands); YaRN's factor multiplies them
    in fp32 too."""
    inv_freq = inverse_frequencies(q, rope)  # (hd/2,)
    if positions is None:
        pos = torch.ones_like(q[0, :, 0, 0], dtype=torch.float32).cumsum(0) - 1  # (T,): 0..T-1
        angles = (pos[:, None] * inv_freq)[None]  # (1, T, hd/2)
    else:
        angles = positions.type_as(inv_freq)[..., None] * inv_freq  # (B, T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # (B or 1, T, 1, hd): pairs (i, i + hd/2)
    cos, sin = angles.cos(), angles.sin()
    if rope.yarn is not None and rope.yarn.cos_sin_factor() != 1.0:
        cos, sin = cos * rope.yarn.cos_sin_factor(), sin * rope.yarn.cos_sin_factor()
    return cos.type_as(q), sin.type_as(q)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves: the 90 degree turn of every pair (i, i + hd/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every feature pair of x (B, T, H, hd) by its angle."""
    return x * cos + rotate_half(x) * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) over the last dimension: adjacent pairs (2i, 2i+1), as
    DeepSeek's checkpoints store them, become the rotate-half pairs (i, i + hd/2) (transformers'
    apply_rotary_pos_emb_interleave). q and k are permuted alike, so q.k is what rotating adjacent pairs gives.
    Strided slices, not a view: a view would write the (tensor-parallel) head count into the traced graph."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
