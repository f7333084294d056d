"""Our Qwen3 in Hugging Face's ``Qwen3ForCausalLM`` layout, and back (models/common/hf_layout.py: Llama's names
plus ``self_attn.{q,k}_norm``).

``config.json`` is read from transformers 4.x and 5.x and written with both spellings (models/common/
hf_config.py). Refused: sliding-window attention (``use_sliding_window``, ``layer_types`` other than
full_attention), attention biases, a RoPE other than plain (Qwen3's YaRN for long contexts). Reading sets the
training length to min(max_position_embeddings, 4096).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import dtype_to_hf, plain_rope_to_hf, refuse, rope_from_hf, shape_from_hf, shape_to_hf
from models.qwen3.config import TRAINING_SEQ_LEN, Qwen3Config
from models.spec import DENSE

ARCHITECTURE, MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"


def _names(cfg: Qwen3Config) -> dict[str, tuple[str, ...]]:
    return hf_layout.hf_names(kinds=(DENSE,) * cfg.n_layers, tie_embeddings=cfg.tie_embeddings, qk_norm=True)


def to_hf(state: dict[str, torch.Tensor], cfg: Qwen3Config) -> dict[str, torch.Tensor]:
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: Qwen3Config) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    return hf_layout.from_hf(name, _names(cfg), family="Qwen3")


def attention_to_hf(cfg) -> dict:
    """The keys Qwen3 and Qwen3-MoE share."""
    return {**shape_to_hf(cfg), **plain_rope_to_hf(cfg.rope_theta), **dtype_to_hf(), "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "use_cache": True}


def attention_from_hf(config: dict) -> dict:
    """Our attention and shape fields from a Qwen3 / Qwen3-MoE config.json; ValueError naming what we do not compute."""
    refuse(config, hidden_act="silu", attention_bias=False, use_sliding_window=False)
    other = sorted(set(config.get("layer_types") or []) - {"full_attention"})
    if other:
        raise ValueError(f"layer_types {other}: this model computes full_attention in every layer")
    theta, _ = rope_from_hf(config)
    context = int(config.get("max_position_embeddings", 32768))
    return dict(**shape_from_hf(config), seq_len=min(context, TRAINING_SEQ_LEN), max_position_embeddings=context,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta)


def config_to_hf(cfg: Qwen3Config) -> dict:
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **attention_to_hf(cfg),
            "intermediate_size": cfg.mlp_width}


def config_from_hf(config: dict) -> Qwen3Config:
    try:
        return Qwen3Config(**attention_from_hf(config), mlp_width=int(config["intermediate_size"]))
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
