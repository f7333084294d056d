"""A DeepSeek-V3 decoder: the shared decoder of models/common/decoder.py with multi-head latent attention
(models/common/latent_attention.py) in every block, a dense SwiGLU MLP in the first ``first_k_dense`` blocks and a
mixture of experts in the others (models/common/moe.py: DeepSeek-V3's sigmoid, group-limited router with its
selection-only bias, and shared experts).

Parameter names: ``tok_emb``, ``layers.<i>.{attn_norm, attn.{q_a, q_a_norm, q, kv_a, kv_a_norm, kv_b, o}, mlp_norm}``
and ``mlp.{gate,up,down}`` or ``moe.{router.{gate, expert_bias}, experts.{w1,w3,w2}, shared_experts.{gate,up,down}}``,
``norm``, ``head`` (models/deepseek_v3/hf.py maps them to Hugging Face's).
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.decoder import Block, Decoder
from models.common.decoder import initial_value as decoder_initial_value
from models.common.latent_attention import LatentAttention
from models.common.mlp import SwiGLU
from models.common.moe import MoE
from models.common.rope import Rope
from models.deepseek_v3.config import DeepseekV3Config, block_kinds
from models.spec import MOE


def attention(cfg: DeepseekV3Config) -> LatentAttention:
    return LatentAttention(d_model=cfg.d_model, shape=cfg.latent(), norm_eps=cfg.norm_eps,
                           rope=Rope(theta=cfg.rope_theta, factor=None, yarn=cfg.rope_yarn),
                           rope_interleave=cfg.rope_interleave, softmax_factor=cfg.softmax_factor())


def _feed_forward(cfg: DeepseekV3Config, kind: str) -> nn.Module:
    if kind == MOE:
        return MoE(d_model=cfg.d_model, expert_width=cfg.expert_width, n_experts=cfg.n_experts, routing=cfg.routing(),
                   shared_width=cfg.n_shared_experts * cfg.expert_width, aux_loss_coef=cfg.router_aux_loss_coef)
    return SwiGLU(cfg.d_model, cfg.mlp_width)


def build(cfg: DeepseekV3Config, *, share_tied_weights: bool = True) -> Decoder:
    blocks = [Block(attn=attention(cfg), feed_forward=_feed_forward(cfg, kind), d_model=cfg.d_model,
                    norm_eps=cfg.norm_eps) for kind in block_kinds(cfg)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg: DeepseekV3Config) -> torch.Tensor:
    """N(0, 0.02) matrices, residual projections scaled by 1/sqrt(2 n_layers), norms ones, the selection bias zeros
    (models/common/decoder.py)."""
    return decoder_initial_value(name, shape, seed=seed, n_layers=cfg.n_layers, tie_embeddings=cfg.tie_embeddings,
                                 router_std=cfg.router_init_std)
