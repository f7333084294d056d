"""Our Qwen3-MoE in Hugging Face's ``Qwen3MoeForCausalLM`` layout, and back: Qwen3's names (models/qwen3/hf.py), a
dense block's ``mlp.{gate,up,down}_proj``, a mixture's ``mlp.gate`` and ``mlp.experts.N.{gate,up,down}_proj``
(stacked in the engine: models/common/hf_layout.py).

``config.json``: the expert count is ``num_experts`` in transformers 4.x and ``num_local_experts`` in 5.x; both
are read and written (models/common/hf_config.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import first
from models.qwen3.hf import attention_from_hf, attention_to_hf
from models.qwen3_moe.config import Qwen3MoeConfig, block_kinds

ARCHITECTURE, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"


def _names(cfg: Qwen3MoeConfig) -> dict[str, tuple[str, ...]]:
    return hf_layout.hf_names(kinds=block_kinds(cfg), tie_embeddings=cfg.tie_embeddings, qk_norm=True,
                              moe=hf_layout.QWEN3_MOE, n_experts=cfg.n_experts)


def to_hf(state: dict[str, torch.Tensor], cfg: Qwen3MoeConfig) -> dict[str, torch.Tensor]:
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: Qwen3MoeConfig) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    return hf_layout.from_hf(name, _names(cfg), family="Qwen3-MoE")


def config_to_hf(cfg: Qwen3MoeConfig) -> dict:
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **attention_to_hf(cfg),
            "intermediate_size": cfg.mlp_width, "moe_intermediate_size": cfg.expert_width,
            "num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": False}


def config_from_hf(config: dict) -> Qwen3MoeConfig:
    try:
        return Qwen3MoeConfig(
            **attention_from_hf(config), mlp_width=int(config["intermediate_size"]),
            n_experts=int(first(config, "num_local_experts", "num_experts")),
            top_k=int(config["num_experts_per_tok"]), expert_width=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
