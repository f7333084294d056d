"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1; DeepSeek-V3 report sec. 2.1.1), as
transformers' DeepseekV3Attention computes it.

Keys and values come from a low-rank latent: ``kv_a`` (Hugging Face's kv_a_proj_with_mqa) projects x to
kv_lora_rank + rope features; the first kv_lora_rank, RMS-normalised (``kv_a_norm``, kv_a_layernorm), are the latent
c_kv that ``kv_b`` (kv_b_proj) expands to every head's nope key and value (per head [k_nope | v], head-major); the
last rope features are one RoPE key k_rope that every head shares (the "mqa" of the name). Queries either go
through a low-rank latent too (``q_a`` -> ``q_a_norm`` -> ``q``: q_a_proj, q_a_layernorm, q_b_proj) or through one
projection (``q``: q_proj) when q_lora_rank is 0 / None; each head's query is [q_nope | q_rope]. RoPE rotates the
rope parts only (interleaved pairs when the checkpoint stores them so: models/common/rope.py ``deinterleave``); the
score of head h is q_h . k_h with k_h = [k_nope_h | k_rope], scaled by 1 / sqrt(nope + rope) times YaRN's softmax
factor (``softmax_factor``, folded into q since SDPA's default scale is 1 / sqrt(q's head dim)). Values have their
own head dimension v. Shapes: x (B, T, D); q (B, H, T, nope + rope); k (B, H, T, nope + rope); v (B, H, T, v).

Heads are ``-1`` in every reshape, and k_rope reaches the heads by broadcasting (no head count in the graph), so a
tensor-parallel shard holding H/mp heads (``q`` and ``kv_b`` column-parallel, ``o`` row-parallel; the down
projections and their norms replicated) traces the same graph. ``rope_key`` is a module of its own so that the
engine can sum its gradient over the ranks' heads: each rank's heads give only part of it (models/common/tp_plan.py).

``kv_latent`` (``LatentKeys``) is the one point where every token's normalised latent and rotated RoPE key exist
before ``kv_b`` expands them: an identity here, named so that an engine splitting the sequence over ranks can put
there what makes the latent whole (compiler/parallelize/latent_gather.py: r + rope values per token to exchange,
against heads x (qk + v) for the expanded keys and values). ``kv_b`` and the view after it read the sequence
length from the latent, so they expand whatever length arrives.

Causality is the core's (attention_core.py: packed documents, context parallelism). With a ``LayerCache``
(models/kv_cache.py) the cache holds the normalised latent and the rotated k_rope of every token (kv_lora_rank + rope
values, not per head), expanded through ``kv_b`` at each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention_core import CausalAttention
from models.common.norm import RMSNorm
from models.common.rope import Rope, apply_rotary, deinterleave, rotary_cos_sin
from models.kv_cache import LayerCache
from models.spec import LatentSizes


class SharedRopeKey(nn.Module):
    """The RoPE key every head shares, (B, T, rope) -> (B, T, 1, rope). Its gradient is a sum over every head that
    used it: under tensor parallelism each rank's heads give part of it (the engine sums them: models/spec.py
    ``HEAD_SHARED``)."""

    def forward(self, k_rope: torch.Tensor) -> torch.Tensor:
        return k_rope.unsqueeze(2)


class LatentKeys(nn.Module):
    """(latent (B, T, r), rotated k_rope (B, T, 1, rope)) -> the same: the latent and RoPE key ``kv_b`` expands into
    keys and values (see the module docstring)."""

    def forward(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return latent, k_rope


class LatentAttention(nn.Module):
    def __init__(self, *, d_model: int, shape: LatentSizes, rope: Rope, norm_eps: float, rope_interleave: bool,
                 softmax_factor: float = 1.0):
        super().__init__()
        s = shape
        self.shape, self.rope, self.rope_interleave, self.softmax_factor = s, rope, rope_interleave, softmax_factor
        if s.q_lora_rank:
            self.q_a = nn.Linear(d_model, s.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(s.q_lora_rank, norm_eps)
        self.q = nn.Linear(s.q_lora_rank or d_model, s.n_heads * s.qk_dim, bias=False)
        self.kv_a = nn.Linear(d_model, s.kv_lora_rank + s.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(s.kv_lora_rank, norm_eps)
        self.kv_b = nn.Linear(s.kv_lora_rank, s.n_heads * (s.nope_dim + s.v_dim), bias=False)
        self.rope_key = SharedRopeKey()
        self.kv_latent = LatentKeys()
        self.o = nn.Linear(s.n_heads * s.v_dim, d_model, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        s = self.shape
        B, T, _ = x.shape  # x: (B, T, D)
        q = self.q(self.q_a_norm(self.q_a(x)) if s.q_lora_rank else x).view(B, T, -1, s.qk_dim)  # (B, T, H, qk)
        q_nope, q_rope = q.split([s.nope_dim, s.rope_dim], dim=-1)
        latent, k_rope = self.kv_a(x).split([s.kv_lora_rank, s.rope_dim], dim=-1)  # (B, T, r), (B, T, rope)
        latent, k_rope = self.kv_a_norm(latent), self.rope_key(k_rope)  # k_rope (B, T, 1, rope)
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = rotary_cos_sin(q_rope, positions, self.rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        latent, k_rope = self.kv_latent(latent, k_rope)  # (B, L, r), (B, L, 1, rope): L = T, or the whole sequence
        causal = {}
        if cache is not None:
            causal = cache.causal_arguments(T, x.device)  # before update: the new queries against cached keys
            latent, k_rope = cache.update_latent(latent, k_rope.squeeze(2))  # (B, L, r), (B, L, rope): L = cached + T
            k_rope = k_rope.unsqueeze(2)
        kv = self.kv_b(latent).view(B, latent.shape[1], -1, s.nope_dim + s.v_dim)  # (B, L, H, nope + v)
        k_nope, v = kv.split([s.nope_dim, s.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, H, qk)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        # Every head's copy of k_rope by broadcasting against k_nope's heads: no head count enters the graph.
        k = torch.cat((k_nope, k_rope + torch.zeros_like(k_nope[..., :1])), dim=-1)  # (B, L, H, qk)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T or L, ...)
        if cache is not None:
            y = F.scaled_dot_product_attention(q, k, v, **causal)
        else:
            y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)  # (B, H, T, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, v) -> (B, T, H v) -> (B, T, D)
