"""A Mixtral decoder (Jiang et al. 2024): Llama's attention (plain RoPE) and in every block a mixture of 8 SwiGLU
experts, 2 per token (models/common/moe.py: softmax router, the two weights renormalised)."""

from __future__ import annotations

import torch

from models.common.attention import Attention
from models.common.decoder import Block, Decoder
from models.common.decoder import initial_value as decoder_initial_value
from models.common.moe import MoE
from models.common.rope import Rope
from models.mixtral.config import MixtralConfig


def build(cfg: MixtralConfig, *, share_tied_weights: bool = True) -> Decoder:
    rope = Rope(theta=cfg.rope_theta, factor=None)
    blocks = [Block(attn=Attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                   head_dim=cfg.head_dim, rope=rope),
                    feed_forward=MoE(d_model=cfg.d_model, expert_width=cfg.mlp_width, n_experts=cfg.n_experts,
                                     routing=cfg.routing(), aux_loss_coef=cfg.router_aux_loss_coef),
                    d_model=cfg.d_model, norm_eps=cfg.norm_eps) for _ in range(cfg.n_layers)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg) -> torch.Tensor:
    return decoder_initial_value(name, shape, seed=seed, n_layers=cfg.n_layers, tie_embeddings=cfg.tie_embeddings,
                                 router_std=cfg.router_init_std)
