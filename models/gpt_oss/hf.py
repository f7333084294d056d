"""Our gpt-oss in Hugging Face's ``GptOssForCausalLM`` layout, and back.

Tensors: names only (models/common/hf_layout.py's decoder names). ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks`` (ours ``attn.sinks.weight``), the router ``mlp.router.{weight,bias}`` (ours
``moe.router.gate``), and the experts stored fused and input-major exactly as ours are
(``mlp.experts.{gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}``, [E, in, out] and [E, out]; gate and up
interleaved), so each is read row by row (``row_wise``): a rank holding experts a..b-1 reads rows a..b-1 of each,
and a quantized folder (the released MXFP4 checkpoints, runtime/checkpoint/quantized/) dequantizes only those.
The experts' two matrices are what the released checkpoints store in MXFP4 (``QUANTIZED``).

``config.json``: transformers 5.x (``rope_parameters`` with ``truncate``) and 4.x (``rope_theta`` + ``rope_scaling``)
are read and both written (models/common/hf_config.py); ``layer_types`` (absent: alternating, sliding first, as
transformers' GptOssConfig), ``sliding_window``, ``swiglu_limit``, ``swiglu_alpha`` (absent: 1.702, transformers'
constant), ``num_local_experts`` and ``num_experts_per_tok`` (the release's ``experts_per_token`` too). Refused with
the key named: another activation, attention without biases, a RoPE other than plain or YaRN, an unknown layer type.
Reading sets the training length to min(max_position_embeddings, 4096).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import dtype_to_hf, first, refuse, rope_from_hf, rope_to_hf, shape_from_hf, shape_to_hf
from models.gpt_oss.config import FULL, SLIDING, TRAINING_SEQ_LEN, GptOssConfig, alternating_layers

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # theirs and ours alike
# The tensors the released checkpoints store in MXFP4 (runtime/checkpoint/quantized/export.py's ``which``), and the
# modules their quantization_config leaves unconverted.
QUANTIZED = ("model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj")
NOT_QUANTIZED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
_ATTENTION = {f"attn.{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")}


def _names(cfg: GptOssConfig) -> dict[str, tuple[str, ...]]:
    names = {hf_layout.TOKEN_EMBEDDING: ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",)}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        block = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                 **_ATTENTION, "attn.sinks.weight": "self_attn.sinks", "moe.router.gate.weight": "mlp.router.weight",
                 "moe.router.gate.bias": "mlp.router.bias", **{f"moe.experts.{e}": f"mlp.experts.{e}" for e in EXPERTS},
                 **({"moe.router.expert_bias": "mlp.router.e_score_correction_bias"} if cfg.expert_bias else {})}
        names.update({f"{ours}.{o}": (f"{theirs}.{h}",) for o, h in block.items()})
    names[hf_layout.HEAD] = names[hf_layout.TOKEN_EMBEDDING] if cfg.tie_embeddings else (hf_layout.HF_HEAD,)
    return names


def to_hf(state: dict[str, torch.Tensor], cfg: GptOssConfig) -> dict[str, torch.Tensor]:
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: GptOssConfig) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    return hf_layout.from_hf(name, _names(cfg), family="gpt-oss")


def is_row_wise(name: str) -> bool:
    """The experts' tensors: row e of ours is row e of theirs."""
    return name.endswith(tuple(f"moe.experts.{e}" for e in EXPERTS))


def config_to_hf(cfg: GptOssConfig) -> dict:
    """``config.json`` for ``GptOssForCausalLM.from_pretrained`` (both transformers generations' keys)."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **shape_to_hf(cfg),
            "intermediate_size": cfg.mlp_width, "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "experts_per_token": cfg.top_k, "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False, "attention_bias": True,
            **rope_to_hf(cfg.rope_theta, cfg.rope_yarn), **dtype_to_hf(), "use_cache": True}


def config_from_hf(config: dict) -> GptOssConfig:
    """A ``GptOssForCausalLM`` config.json (transformers 4.x or 5.x) -> our config; ValueError naming the key for what
    this model does not compute."""
    refuse(config, hidden_act="silu", attention_bias=True)
    theta, rope = rope_from_hf(config, rope_types=("default", "yarn"))
    try:
        shape = shape_from_hf(config)
        layer_types = config.get("layer_types") or [SLIDING if i in alternating_layers(shape["n_layers"]) else FULL
                                                    for i in range(shape["n_layers"])]
        if not set(layer_types) <= {SLIDING, FULL} or len(layer_types) != shape["n_layers"]:
            raise ValueError(f"layer_types {list(layer_types)}: one of {SLIDING}, {FULL} for each of the "
                             f"{shape['n_layers']} layers (num_hidden_layers)")
        context = int(config.get("max_position_embeddings", 131072))
        return GptOssConfig(
            **shape, seq_len=min(context, TRAINING_SEQ_LEN), mlp_width=int(config["intermediate_size"]),
            n_experts=int(first(config, "num_local_experts", "num_experts")),
            top_k=int(first(config, "num_experts_per_tok", "experts_per_token")),
            sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
            sliding_window=int(config.get("sliding_window") or 128), swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.9)),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=theta, max_position_embeddings=context, **rope)
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
