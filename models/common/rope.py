"""Rotary position embeddings (RoFormer, Su et al. 2021), plain or with Llama 3's frequency scaling.

Convention: Hugging Face's "rotate half". Feature i of a head is paired with feature i + head_dim/2 and the
pair rotated by angle position * inv_freq[i]; Hugging Face's Llama checkpoints are stored for this
convention, so their q and k weights load unchanged. Meta's original checkpoints rotate adjacent features
(2i, 2i+1) instead; loading those would permute the rows of q and k within each head (Hugging Face's
convert_llama_weights_to_hf.py does exactly that), which this family does not need.

Nothing here creates a tensor on a device of its own (the model is traced on the meta device and the graph
must run anywhere): frequency indices and positions are derived from the input with ``*_like`` ops, and
results are cast with ``type_as`` (a traced ``.to(dtype)`` kept an assertion on the meta device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    theta: float  # the base: inv_freq[i] = theta ** (-2i / head_dim)
    factor: float | None  # Llama 3 scaling factor; None: plain RoPE
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


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


def rotary_cos_sin(q: torch.Tensor, positions: torch.Tensor | None, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, feature) angle for q of shape (B, T, H, hd), in q's dtype, shaped to
    broadcast against it: (1, T, 1, hd) for positions 0..T-1 (``positions`` None), (B, T, 1, hd) for
    per-token ``positions`` (B, T) int64. Angles are computed in fp32 and cast after cos / sin, as Hugging
    Face does (bf16 angles would lose whole turns at positions in the thousands)."""
    inv_freq = inverse_frequencies(q, rope)  # (hd/2,)
    if positions is None:
        pos = torch.ones_like(q[0, :, 0, 0], dtype=torch.float32).cumsum(0) - 1  # (T,): 0..T-1
        angles = (pos[:, None] * inv_freq)[None]  # (1, T, hd/2)
    else:
        angles = positions.type_as(inv_freq)[..., None] * inv_freq  # (B, T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # (B or 1, T, 1, hd): pairs (i, i + hd/2)
    return angles.cos().type_as(q), angles.sin().type_as(q)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves: the 90 degree turn of every pair (i, i + hd/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every feature pair of x (B, T, H, hd) by its angle."""
    return x * cos + rotate_half(x) * sin
