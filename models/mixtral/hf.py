"""Our Mixtral in Hugging Face's ``MixtralForCausalLM`` layout, and back: Llama's attention names, the router
``block_sparse_moe.gate`` and the experts ``block_sparse_moe.experts.N.{w1,w3,w2}`` (gate, up, down; stacked in
the engine: models/common/hf_layout.py).

``config.json`` read from transformers 4.x and 5.x (``head_dim`` may be null: d_model / n_heads) and written with
both spellings. Refused: a sliding window (Mistral 7B's; Mixtral's is null), router jitter noise, a RoPE other
than plain. Reading sets the training length to min(max_position_embeddings, 4096).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import dtype_to_hf, plain_rope_to_hf, refuse, rope_from_hf, shape_from_hf, shape_to_hf
from models.mixtral.config import TRAINING_SEQ_LEN, MixtralConfig, block_kinds

ARCHITECTURE, MODEL_TYPE = "MixtralForCausalLM", "mixtral"


def _names(cfg: MixtralConfig) -> dict[str, tuple[str, ...]]:
    return hf_layout.hf_names(kinds=block_kinds(cfg), tie_embeddings=cfg.tie_embeddings, moe=hf_layout.MIXTRAL,
                              n_experts=cfg.n_experts)


def to_hf(state: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: MixtralConfig) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    return hf_layout.from_hf(name, _names(cfg), family="Mixtral")


def config_to_hf(cfg: MixtralConfig) -> dict:
    config = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **shape_to_hf(cfg),
              **plain_rope_to_hf(cfg.rope_theta), **dtype_to_hf(), "intermediate_size": cfg.mlp_width,
              "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
              "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0, "sliding_window": None,
              "output_router_logits": False, "use_cache": True}
    if cfg.vocab_size == 32000:  # Mixtral's tokenizer: <s>, </s>
        config.update(bos_token_id=1, eos_token_id=2)
    return config


def config_from_hf(config: dict) -> MixtralConfig:
    refuse(config, hidden_act="silu", sliding_window=None, router_jitter_noise=0.0)
    theta, _ = rope_from_hf(config)
    try:
        context = int(config.get("max_position_embeddings", 4096 * 32))  # MixtralConfig's default
        return MixtralConfig(**shape_from_hf(config), seq_len=min(context, TRAINING_SEQ_LEN),
                             mlp_width=int(config["intermediate_size"]), n_experts=int(config["num_local_experts"]),
                             top_k=int(config["num_experts_per_tok"]),
                             router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
                             norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=theta,
                             max_position_embeddings=context)
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
