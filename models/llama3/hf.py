"""Our Llama's weights and config in Hugging Face's ``LlamaForCausalLM`` layout, and back, with torch and json.

Tensors: names only. Both sides store ``nn.Linear`` weights [out, in] and apply RoPE in the rotate-half
convention (rope.py), so no transpose and no q/k permutation: ``layers.i.attn.q`` is
``model.layers.i.self_attn.q_proj``, and so on. A tied model has no ``lm_head.weight`` (Hugging Face ties it
to ``model.embed_tokens`` on loading and does not save it).

``config.json``: written as transformers 4.x does (``rope_theta`` and a ``rope_scaling`` dict whose
``rope_type`` is "llama3"); read from 4.x (``rope_scaling`` with ``rope_type``, or the older ``type`` key) and
from 5.x (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the llama3 factors). A config
Hugging Face reads but this model would compute differently (another rope type, a non-SiLU activation,
biases, partial rotary dimensions) is refused with a ValueError naming the key.

The training sequence length is not in ``config.json`` (``max_position_embeddings`` is the published
context: 131,072 for Llama 3.1 / 3.2). Reading a config sets ``seq_len`` to min(max_position_embeddings,
8192), Llama 3's pre-training length; ``--seq-len`` chooses another.
"""

from __future__ import annotations

from typing import Callable

import torch

from models.common import hf_layout
from models.common.hf_config import rope_from_hf
from models.llama3.config import DEFAULT_MULTIPLE_OF, MODEL_SIZES, LlamaConfig
from models.spec import DENSE

DEFAULT_TRAINING_SEQ_LEN = 8192  # Llama 3's pre-training context, before its long-context stage


def _names(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> its Hugging Face tensor, the head included (the embedding's when tied)."""
    return hf_layout.hf_names(kinds=(DENSE,) * cfg.n_layers, tie_embeddings=cfg.tie_embeddings)


def to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict (a tied head may be listed or not) -> a ``LlamaForCausalLM`` state dict."""
    return hf_layout.to_hf(state, _names(cfg))


def from_hf(name: str, cfg: LlamaConfig) -> tuple[tuple[str, ...], Callable[[torch.Tensor], torch.Tensor]]:
    """The ``LlamaForCausalLM`` tensor our parameter ``name`` is (the inverse of ``to_hf``)."""
    return hf_layout.from_hf(name, _names(cfg), family="Llama 3")


def config_to_hf(cfg: LlamaConfig) -> dict:
    """``config.json`` for ``LlamaForCausalLM.from_pretrained`` (transformers 4.x keys, read by 5.x too)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }
    if cfg.rope_factor is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context}
    if cfg.vocab_size == 128256:  # Llama 3's tokenizer: <|begin_of_text|>, <|end_of_text|>
        config.update(bos_token_id=128000, eos_token_id=128001)
    return config


def config_from_hf(config: dict) -> LlamaConfig:
    """A Llama ``config.json`` (transformers 4.x or 5.x) -> our config; ValueError naming the key for what
    this model does not compute."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act {activation!r}: this Llama's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key} true: this Llama has no biases")
    theta, rope = rope_from_hf(config, rope_types=("default", "llama3"))
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        width = int(config["intermediate_size"])
        context = int(config.get("max_position_embeddings", 2048))  # LlamaConfig's default
        multiplier, multiple_of = _width_rule(d, width)
        return LlamaConfig(
            n_layers=int(config["num_hidden_layers"]), d_model=d, n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads), seq_len=min(context, DEFAULT_TRAINING_SEQ_LEN),
            vocab_size=int(config["vocab_size"]), mlp_width=width, head_dim=int(config.get("head_dim") or d // heads),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, max_position_embeddings=context,
            ffn_dim_multiplier=multiplier, multiple_of=multiple_of, **rope)
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None


def _width_rule(d_model: int, width: int) -> tuple[float | None, int]:
    """The width rule's inputs (ffn_dim_multiplier, multiple_of) of a named size of this shape, so that an
    override of d_model recomputes the width that size's way; Meta's defaults otherwise."""
    for size in MODEL_SIZES.values():
        if (size.d_model, size.mlp_width) == (d_model, width):
            return size.ffn_dim_multiplier, size.multiple_of
    return None, DEFAULT_MULTIPLE_OF
