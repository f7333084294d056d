"""Grouped-query attention (Ainslie et al. 2023) with rotary positions, as Llama 3, Qwen3, Mixtral and gpt-oss compute
it.

q, k, v and o are separate projections, without biases but gpt-oss's (``bias``) (a column-parallel shard of k and v
then holds whole key/value heads, whatever the group size). gpt-oss adds a sliding window on some layers
(``window``) and attention sinks (``sinks``: ``AttentionSinks``, one logit per head joining the softmax's
denominator). Qwen3 (``qk_norm_eps``) adds an RMSNorm over each head's features of
q and of k before RoPE (its q_norm / k_norm). Heads are ``-1`` in every reshape and the key/value heads are
shared by ``scaled_dot_product_attention(enable_gqa=True)`` (key/value head h serves query heads h*g .. h*g+g-1,
Hugging Face's repeat_kv order) instead of being copied out H wide: a tensor-parallel shard holding H/mp query
heads and Hkv/mp key/value heads keeps the group size and traces the same graph.

Positions: none (the traced case of plain sequences), 0..T-1; else per-token ``positions`` (B, T) rotate q and k
(packed documents restart them; a context-parallel slice of a sequence has its tokens' global positions).
Causality is the core's (attention_core.py ``CausalAttention``, the submodule ``core``): within each document of
``documents`` (B, T), without a T x T mask. With a ``LayerCache`` the new tokens at ``positions`` after the
cached ones attend to every cached key they see (models/kv_cache.py; within the window, with the sinks).
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention_core import CausalAttention, SinkAttention
from models.common.norm import RMSNorm
from models.common.rope import Rope, apply_rotary, rotary_cos_sin
from models.kv_cache import LayerCache


class AttentionSinks(nn.Module):
    """One learned logit per head (``weight`` (H,), Hugging Face's ``self_attn.sinks``) joining each query's softmax
    as a column that takes no value: p = softmax([scores, sink])[:-1] (attention_core.py ``SinkAttention``).
    ``forward(q)``: q (B, H, T, hd) -> every query's sink logit (B, H, T). Its input and weight are per head, so tensor
    parallelism splits both with the heads (models/spec.py ``HEADWISE``)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.weight[None, :, None].expand(q.shape[0], -1, q.shape[2])  # (B, H, T)


class Attention(nn.Module):
    def __init__(self, *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: Rope,
                 qk_norm_eps: float | None = None, bias: bool = False, window: int | None = None,
                 sinks: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.sinks = AttentionSinks(n_heads) if sinks else None
        self.core = SinkAttention(window=window) if sinks else CausalAttention(window=window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, D)
        q = self.q(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.k(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.v(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over hd
        cos, sin = rotary_cos_sin(q, positions, self.rope)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
        sinks = () if self.sinks is None else (self.sinks(q),)  # (B, H, T): each query's head's sink
        if cache is not None:
            # (B, Hkv, cached + T, hd): cached after RoPE, before any sharing; a sliding layer's cache returns only
            # the keys its new queries can see (models/kv_cache.py), so ``cached`` is what it kept, not its length
            k, v = cache.update(k, v, window=self.core.window)
            cached = k.shape[2] - T  # the new queries stand after the cached keys
            y = self.core.cached(q, k, v, q_offset=cached, sinks=sinks[0] if sinks else None)
        else:
            y = self.core(q, k, v, *sinks) if documents is None else self.core(q, k, v, *sinks, documents)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, hd) -> (B, T, H*hd) -> (B, T, D)
