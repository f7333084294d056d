"""A gpt-oss decoder: the shared decoder of models/common/decoder.py with grouped-query attention carrying biases and
sinks (sliding-window on the layers ``layer_types`` names so, YaRN RoPE) and in every block the shared mixture-of-
experts block with gpt-oss's router (a bias, softmax over the top-k logits) and clamped-SwiGLU experts
(models/gpt_oss/experts.py).

Parameter names: ``tok_emb``, ``layers.<i>.{attn_norm, attn.{q,k,v,o}.{weight,bias}, attn.sinks.weight, mlp_norm,
moe.router.gate.{weight,bias}, moe.experts.{gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}}``, ``norm``,
``head`` (models/gpt_oss/hf.py maps them to Hugging Face's).
"""

from __future__ import annotations

import math

import torch

from models.common.attention import Attention
from models.common.decoder import Block, Decoder
from models.common.moe import MoE
from models.common.rope import Rope
from models.gpt_oss.config import GptOssConfig
from models.gpt_oss.experts import ClampedSwiGLUExperts
from models.spec import TIED_EMBEDDINGS, name_seeded_normal

# Zeros at the start: every bias, the sinks (each head's sink then weighs e^0 = 1 in its denominator), a router's
# selection bias. Scaled by 1/sqrt(2 n_layers): what joins the residual stream (GPT-2's rule).
_ZEROS = ("bias", "sinks.weight", "router.expert_bias")
_RESIDUAL = ("attn.o.weight", "experts.down_proj")


def build(cfg: GptOssConfig, *, share_tied_weights: bool = True) -> Decoder:
    rope = Rope(theta=cfg.rope_theta, factor=None, yarn=cfg.rope_yarn)
    blocks = [Block(attn=Attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                   head_dim=cfg.head_dim, rope=rope, bias=True, window=cfg.window(i), sinks=True),
                    feed_forward=MoE(d_model=cfg.d_model, expert_width=cfg.mlp_width, n_experts=cfg.n_experts,
                                     routing=cfg.routing(), aux_loss_coef=cfg.router_aux_loss_coef,
                                     experts=ClampedSwiGLUExperts(cfg.d_model, cfg.mlp_width, cfg.n_experts,
                                                                  limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)),
                    d_model=cfg.d_model, norm_eps=cfg.norm_eps) for i in range(cfg.n_layers)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg: GptOssConfig) -> torch.Tensor:
    """Norms ones; biases, sinks and a selection bias zeros; routers N(0, router_init_std); other matrices and the
    stacked experts N(0, 0.02), those joining the residual stream (o, the experts' down) scaled by 1/sqrt(2 n_layers).
    A tied copy takes its source's name."""
    if cfg.tie_embeddings:
        name = TIED_EMBEDDINGS.get(name, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(_ZEROS):
        return torch.zeros(shape)
    std = cfg.router_init_std if name.endswith("router.gate.weight") else 0.02
    if name.endswith(_RESIDUAL):
        std /= math.sqrt(2 * cfg.n_layers)
    return name_seeded_normal(name, shape, seed=seed, std=std)
