"""A Llama 3 decoder (Dubey et al. 2024; Touvron et al. 2023): RMSNorm, grouped-query attention with rotary
positions, SwiGLU MLP, no biases. Written for clarity, not distribution: nothing here knows about ranks.

It follows the naming contract of models/spec.py (``tok_emb``, ``layers.<i>``, ``norm``, ``head``) and the
tracing rules the engine needs:
- attention reshapes with ``-1`` heads (q to (B, T, -1, hd), k and v likewise), and repeats each key/value
  head by the constant group size n_heads // n_kv_heads, so a tensor-parallel shard holding H/mp query heads
  and Hkv/mp key/value heads traces the same graph as the whole model;
- forward creates no tensor on a device of its own (positions and rotary frequencies come from the input
  through ``*_like`` ops, rope.py) and the model has no buffers: the engine materialises parameters only.

Document masking: ``forward(tokens, positions)`` takes each token's position within its document (B, T)
int64, 0 starting a document. RoPE then rotates by those positions and attention is block-causal: token i
sees tokens j <= i of its own document (the document id is the running count of zeros in ``positions``).
Without ``positions``: positions 0..T-1 and plain causal attention (what the engine traces today).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.kv_cache import KVCache, LayerCache
from models.llama3.config import LlamaConfig
from models.llama3.rope import Rope, apply_rotary, rotary_cos_sin
from models.spec import TIED_EMBEDDINGS, document_mask, name_seeded_normal, run_blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang and Sennrich 2019), computed in fp32 and cast back to the input's dtype
    before the weight is applied, as Hugging Face's LlamaRMSNorm does (so bf16 runs round alike).

    The mean square comes from ``vector_norm(dtype=float32)`` (x cast before squaring), and x times an fp32
    scale is fp32: no explicit cast of x. ``x.float()`` of an fp32 input traces on the meta device to an
    assertion that x is on meta (failing at run time), and ``type_as`` of an fp32 input returns x itself, so
    the trace would hand the cast to the residual stream too."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D) -> sum of squares (B, T, 1) in fp32 -> x / rms(x) in fp32 -> x's dtype, then the weight.
        sum_of_squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square()
        normed = x * torch.rsqrt(sum_of_squares / x.shape[-1] + self.eps)
        return self.weight * normed.type_as(x)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, T, Hkv, hd) -> (B, T, Hkv * group, hd): key/value head h serves query heads h*group..h*group+group-1
    (Hugging Face's repeat_kv order). ``group`` is the same on every tensor-parallel shard."""
    if group == 1:
        return x
    return x.unsqueeze(3).expand(-1, -1, -1, group, -1).flatten(2, 3)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.rope = Rope(theta=cfg.rope_theta, factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                         high_freq_factor=cfg.rope_high_freq_factor, original_context=cfg.rope_original_context)
        # Separate projections (not one fused qkv): a column-parallel shard of k and v then holds whole
        # key/value heads, whatever the group size.
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # x: (B, T, D). Head counts are -1, never n_heads / n_kv_heads (see the module docstring).
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.k(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.v(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        if cache is not None:
            return self._decode(q, k, v, positions, cache)
        cos, sin = rotary_cos_sin(q, positions, self.rope)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = repeat_kv(k, self.group), repeat_kv(v, self.group)  # (B, T, H, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if positions is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, hd) -> (B, T, H*hd) -> (B, T, D)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cache: LayerCache) -> torch.Tensor:
        """Attention of T new tokens at ``positions`` (B, T) (their places after the cached ones) over every
        cached key and value: q, k rotated at those positions, k and v cached with their Hkv heads and
        repeated for the query heads afterwards (models/kv_cache.py)."""
        B, T = q.shape[:2]
        cos, sin = rotary_cos_sin(q, positions, self.rope)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = cache.mask(T, q.device)
        k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2))  # (B, Hkv, cached + T, hd)
        # repeat_interleave on the head dimension: key/value head h serves query heads h*g .. h*g+g-1 (repeat_kv)
        k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)  # (B, H, S, hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate x) * up x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.down = nn.Linear(cfg.mlp_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Pre-norm residual blocks. The attention is called with positions only when there are some, so that
        # the traced graph (and any input hook on it) sees the one input it has today.
        h = self.attn_norm(x)
        if cache is not None:
            x = x + self.attn(h, positions, cache=cache)
        else:
            x = x + (self.attn(h) if positions is None else self.attn(h, positions))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, *, share_tied_weights: bool = True):
        """``share_tied_weights=False`` builds a tied model's head with a weight of its own (to be kept equal
        to the embedding by the caller): what a pipeline that splits the two apart needs."""
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings and share_tied_weights:
            self.head.weight = self.tok_emb.weight  # (V, D) both

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) int64 -> (B, T, D). Positions enter in every block (RoPE), not here; the argument keeps the
        signature of forward."""
        return self.tok_emb(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # (B, T, D) -> (B, T, V)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self.decode(tokens, cache)
        return self.logits(run_blocks(self.layers, self.embed(tokens, positions), positions))

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """(B, t) new tokens after the cache's positions -> their logits (B, t, V). RoPE rotates each at its
        place after the cached ones (the first new one's is cache.length)."""
        positions = cache.positions(tokens)
        x = self.tok_emb(tokens)
        for i, block in enumerate(self.layers.values()):
            x = block(x, positions, cache=cache.layer(i))
        cache.advance(tokens.shape[1])
        return self.logits(x)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg: LlamaConfig) -> torch.Tensor:
    """The initial value of parameter ``name`` (fp32, CPU), from a generator seeded by (seed, name): N(0, 0.02)
    for matrices and the embedding, residual projections (attn.o, mlp.down) scaled by 1/sqrt(2 * n_layers)
    (GPT-2's rule, as the gpt2 family), norms ones. A tied copy takes its
    source's name."""
    if cfg.tie_embeddings:
        name = TIED_EMBEDDINGS.get(name, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("attn.o.weight", "mlp.down.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    return name_seeded_normal(name, shape, seed=seed, std=std)


def build(cfg: LlamaConfig, *, share_tied_weights: bool = True) -> Llama:
    return Llama(cfg, share_tied_weights=share_tied_weights)
