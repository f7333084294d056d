"""A Llama 3 decoder (Dubey et al. 2024; Touvron et al. 2023): RMSNorm, grouped-query attention with rotary
positions (Llama 3's frequency scaling), SwiGLU MLP, no biases; the shared decoder of models/common/decoder.py.

Parameter names (what checkpoints, tensor-parallel plans and the Hugging Face adapter key on): ``tok_emb``,
``layers.<i>.{attn_norm, attn.{q,k,v,o}, mlp_norm, mlp.{gate,up,down}}``, ``norm``, ``head``.
"""

from __future__ import annotations

from models.common.attention import Attention
from models.common.decoder import Block, Decoder
from models.common.decoder import initial_value as decoder_initial_value
from models.common.mlp import SwiGLU
from models.common.rope import Rope
from models.llama3.config import LlamaConfig


def build(cfg: LlamaConfig, *, share_tied_weights: bool = True) -> Decoder:
    rope = Rope(theta=cfg.rope_theta, factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor, original_context=cfg.rope_original_context)
    blocks = [Block(attn=Attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                   head_dim=cfg.head_dim, rope=rope),
                    feed_forward=SwiGLU(cfg.d_model, cfg.mlp_width), d_model=cfg.d_model, norm_eps=cfg.norm_eps)
              for _ in range(cfg.n_layers)]
    return Decoder(blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model, norm_eps=cfg.norm_eps,
                   tie_embeddings=cfg.tie_embeddings, share_tied_weights=share_tied_weights)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg: LlamaConfig):
    """N(0, 0.02) matrices, residual projections scaled by 1/sqrt(2 n_layers), norms ones (decoder.py)."""
    return decoder_initial_value(name, shape, seed=seed, n_layers=cfg.n_layers, tie_embeddings=cfg.tie_embeddings)
