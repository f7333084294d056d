"""A Qwen3 dense decoder (Yang et al. 2025): Llama's decoder (models/common/decoder.py) with a head_dim of its own
and an RMSNorm over each head of q and of k before RoPE (``attn.q_norm``, ``attn.k_norm``); plain RoPE."""

from __future__ import annotations

import torch

from models.common.attention import Attention
from models.common.decoder import Block, Decoder
from models.common.decoder import initial_value as decoder_initial_value
from models.common.mlp import SwiGLU
from models.common.rope import Rope
from models.qwen3.config import Qwen3Config


def attention(cfg) -> Attention:
    """Qwen3's attention (q/k norms with the model's eps), also Qwen3-MoE's."""
    return Attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     rope=Rope(theta=cfg.rope_theta, factor=None), qk_norm_eps=cfg.norm_eps)


def build(cfg: Qwen3Config, *, share_tied_weights: bool = True) -> Decoder:
    blocks = [Block(attn=attention(cfg), feed_forward=SwiGLU(cfg.d_model, cfg.mlp_width), d_model=cfg.d_model,
                    norm_eps=cfg.norm_eps) for _ in range(cfg.n_layers)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg) -> torch.Tensor:
    return decoder_initial_value(name, shape, seed=seed, n_layers=cfg.n_layers, tie_embeddings=cfg.tie_embeddings)
