"""Our DeepSeek-V3 in Hugging Face's ``DeepseekV3ForCausalLM`` layout, and back.

Tensors: names only (models/common/hf_layout.py). The latent attention is ``self_attn.{q_a_proj, q_a_layernorm,
q_b_proj}`` (or ``self_attn.q_proj`` without a q LoRA rank), ``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj}``; the rope features stay as the file stores them (interleaved pairs when ``rope_interleave``: the
attention de-interleaves at run time, as transformers does). Dense blocks ``mlp.{gate,up,down}_proj``; a mixture's
router ``mlp.gate.weight`` and its selection bias ``mlp.gate.e_score_correction_bias`` (a buffer there, which
picks the experts), ``mlp.experts.N.{gate,up,down}_proj`` (stacked here) and ``mlp.shared_experts.{gate,up,down}_proj``.
Multi-token prediction: ``num_nextn_predict_layers`` is the model's ``mtp_depth``; its tensors (``model.layers.{num_hidden_layers
+ k}.*`` in DeepSeek's own release; transformers saves none) are named by models/common/mtp.py for every family.

``config.json``: a folder is this family's when its ``architectures`` names ``DeepseekV3ForCausalLM`` (Kimi K2 and
Moonlight keep that architecture under their own ``model_type``). Read from transformers 4.x (``rope_theta`` +
``rope_scaling``) and 5.x (``rope_parameters``) and written with both. Refused with the key named: another activation,
attention biases, a router other than V3's (``scoring_func`` softmax, ``topk_method`` other than noaux_tc), MoE
blocks at another frequency (``moe_layer_freq``), a RoPE other than plain or YaRN. Reading sets the training length to
min(max_position_embeddings, 4096), DeepSeek-V3's pretraining length. A key absent takes transformers'
DeepseekV3Config default (a ``q_lora_rank`` of null: one q projection).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import dtype_to_hf, refuse, rope_from_hf, rope_to_hf
from models.deepseek_v3.config import DeepseekV3Config, block_kinds

ARCHITECTURE, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"
TRAINING_SEQ_LEN = 4096

_KV = {"attn.kv_a": "self_attn.kv_a_proj_with_mqa", "attn.kv_a_norm": "self_attn.kv_a_layernorm",
       "attn.kv_b": "self_attn.kv_b_proj", "attn.o": "self_attn.o_proj"}
_Q_LORA = {"attn.q_a": "self_attn.q_a_proj", "attn.q_a_norm": "self_attn.q_a_layernorm", "attn.q": "self_attn.q_b_proj"}
_Q = {"attn.q": "self_attn.q_proj"}


# DeepSeek-V3's release stores every linear weight inside the decoder layers as FP8 blocks (q_a/q_b/kv_a/kv_b/o,
# the dense, shared and routed experts' MLPs); the router, norms, embeddings and head stay high precision.
FP8_QUANTIZED = ("model.layers.*_proj.weight", "model.layers.*_proj_with_mqa.weight")


def _names(cfg: DeepseekV3Config) -> dict[str, tuple[str, ...]]:
    return hf_layout.hf_names(kinds=block_kinds(cfg), tie_embeddings=cfg.tie_embeddings, moe=hf_layout.QWEN3_MOE,
                              n_experts=cfg.n_experts, shared_experts=cfg.n_shared_experts > 0,
                              expert_bias=cfg.expert_bias, attention={**(_Q_LORA if cfg.q_lora_rank else _Q), **_KV})


def to_hf(state: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: DeepseekV3Config) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    return hf_layout.from_hf(name, _names(cfg), family="DeepSeek-V3")


def config_to_hf(cfg: DeepseekV3Config) -> dict:
    """``config.json`` for ``DeepseekV3ForCausalLM.from_pretrained`` (both transformers generations' keys)."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_width, "moe_intermediate_size": cfg.expert_width,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "n_shared_experts": cfg.n_shared_experts, "first_k_dense_replace": cfg.first_k_dense,
            "n_group": cfg.n_group, "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.routed_scaling_factor, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            **rope_to_hf(cfg.rope_theta, cfg.rope_yarn), "rope_interleave": cfg.rope_interleave,
            "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
            "tie_word_embeddings": cfg.tie_embeddings, "num_nextn_predict_layers": cfg.mtp_depth,
            **dtype_to_hf(), "use_cache": True}


def config_from_hf(config: dict) -> DeepseekV3Config:
    """A ``DeepseekV3ForCausalLM`` config.json (transformers 4.x or 5.x) -> our config; ValueError naming the key for
    what this model does not compute."""
    refuse(config, hidden_act="silu", attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc",
           moe_layer_freq=1)
    theta, rope = rope_from_hf(config, rope_types=("default", "yarn"))
    try:
        context = int(config.get("max_position_embeddings", 4096))  # DeepseekV3Config's default
        return DeepseekV3Config(
            n_layers=int(config["num_hidden_layers"]), d_model=int(config["hidden_size"]),
            n_heads=int(config["num_attention_heads"]), seq_len=min(context, TRAINING_SEQ_LEN),
            vocab_size=int(config["vocab_size"]), mlp_width=int(config["intermediate_size"]),
            q_lora_rank=int(config.get("q_lora_rank", 1536) or 0), kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]), n_experts=int(config["n_routed_experts"]),
            top_k=int(config["num_experts_per_tok"]), expert_width=int(config["moe_intermediate_size"]),
            n_shared_experts=int(config.get("n_shared_experts", 1)),
            first_k_dense=int(config.get("first_k_dense_replace", 3)), n_group=int(config.get("n_group", 8)),
            topk_group=int(config.get("topk_group", 4)), norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)), rope_theta=theta,
            rope_interleave=bool(config.get("rope_interleave", True)), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), max_position_embeddings=context,
            mtp_depth=int(config.get("num_nextn_predict_layers") or 0), **rope)
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
