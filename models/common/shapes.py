"""Shape facts the decoder families share: why a shape cannot run on mp tensor-parallel ranks (a ``ShapeProblem``
in config fields), parameter counts in closed form, and training FLOPs per token."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.spec import MP, ShapeProblem, divisors

SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "seq_len", "vocab_size", "mlp_width", "tie_embeddings")


def with_overrides(base: Any, *, derive_head_dim: bool, **given: Any) -> Any:
    """A named size with the flags' overrides (``SHAPE_FIELDS``; None: keep). ``derive_head_dim``: a new d_model or
    head count makes head_dim d_model / n_heads (Mixtral); otherwise head_dim is a setting of its own and stays
    (Qwen3). The published context grows to a longer training sequence, never shrinks."""
    fields = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(fields) - set(SHAPE_FIELDS))
    if unknown:
        raise TypeError(f"unknown overrides {unknown}")
    cfg = dataclasses.replace(base, **fields)
    if derive_head_dim and (cfg.d_model, cfg.n_heads) != (base.d_model, base.n_heads) and cfg.n_heads:
        cfg = dataclasses.replace(cfg, head_dim=cfg.d_model // cfg.n_heads)
    return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, cfg.seq_len))


def check_attention(*, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, mp: int,
                    head_dim_derived: bool) -> ShapeProblem | None:
    """Why grouped-query attention of this shape cannot run with ``mp``-way tensor parallelism, or None. q is
    sharded by query heads and k / v by key/value heads, so mp must divide both head counts; then every shard
    holds whole GQA groups. ``head_dim_derived``: head_dim is d_model / n_heads (Llama), not a setting of its own
    (Qwen3)."""
    for field, count in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if count <= 0:
            return ShapeProblem(field, count, "be positive")
    if head_dim_derived and d_model % n_heads:
        return ShapeProblem("n_heads", n_heads, "divide", "d_model", d_model, valid=divisors(d_model))
    if n_heads % n_kv_heads:
        return ShapeProblem("n_kv_heads", n_kv_heads, "divide", "n_heads", n_heads, valid=divisors(n_heads))
    if head_dim % 2:  # RoPE rotates pairs of dimensions
        return ShapeProblem("head_dim", head_dim, "be even", reason="for rotary embeddings",
                            derived_from=("d_model", "n_heads") if head_dim_derived else ())
    if n_kv_heads % mp:
        return ShapeProblem(MP, mp, "divide", "n_kv_heads", n_kv_heads, valid=divisors(n_kv_heads))
    if n_heads % mp:
        return ShapeProblem(MP, mp, "divide", "n_heads", n_heads, valid=divisors(n_heads))
    return None


def check_width(width: int, mp: int) -> ShapeProblem | None:
    """A column-parallel SwiGLU splits its hidden units: mp must divide the width."""
    if width % mp:
        return ShapeProblem(MP, mp, "divide", "mlp_width", width, valid=divisors(width))
    return None


def attention_params(*, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool = False) -> int:
    """q, k, v, o (no biases), the two RMSNorms of the block, and Qwen3's per-head q/k norms."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    return d_model * q + 2 * d_model * kv + q * d_model + 2 * d_model + (2 * head_dim if qk_norm else 0)


def flops_per_token(*, matmul_params: int, n_layers: int, seq_len: int, n_heads: int, head_dim: int) -> float:
    """Training FLOPs per token, 6N + 12 L T (n_heads * head_dim) (PaLM, Chowdhery et al. 2022, appendix B): N the
    parameters a token's matrix products use (a mixture's activated experts only, not the embedding lookup); the
    second term attention's QK^T and AV over all query heads, forward and backward. Recomputation is not counted:
    MFU measures useful work."""
    return 6.0 * matmul_params + 12.0 * n_layers * seq_len * n_heads * head_dim
