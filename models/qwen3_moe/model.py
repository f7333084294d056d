"""A Qwen3-MoE decoder: Qwen3's attention (models/qwen3/model.py), and in each block a mixture of experts
(models/common/moe.py: softmax top-k router, weights renormalised with ``norm_topk_prob``, no shared experts) or,
in the blocks ``block_kinds`` makes dense, a SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from models.common.decoder import Block, Decoder
from models.common.decoder import initial_value as decoder_initial_value
from models.common.mlp import SwiGLU
from models.common.moe import MoE
from models.qwen3.model import attention
from models.qwen3_moe.config import Qwen3MoeConfig, block_kinds
from models.spec import MOE


def _feed_forward(cfg: Qwen3MoeConfig, kind: str) -> nn.Module:
    if kind == MOE:
        return MoE(d_model=cfg.d_model, expert_width=cfg.expert_width, n_experts=cfg.n_experts,
                   routing=cfg.routing(), aux_loss_coef=cfg.router_aux_loss_coef)
    return SwiGLU(cfg.d_model, cfg.mlp_width)


def build(cfg: Qwen3MoeConfig, *, share_tied_weights: bool = True) -> Decoder:
    blocks = [Block(attn=attention(cfg), feed_forward=_feed_forward(cfg, kind), d_model=cfg.d_model,
                    norm_eps=cfg.norm_eps) for kind in block_kinds(cfg)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg) -> torch.Tensor:
    return decoder_initial_value(name, shape, seed=seed, n_layers=cfg.n_layers, tie_embeddings=cfg.tie_embeddings,
                                 router_std=cfg.router_init_std)
