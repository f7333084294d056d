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

from models.llama3.config import DEFAULT_MULTIPLE_OF, MODEL_SIZES, LlamaConfig

_BLOCK = {  # ours (in layers.i) -> Hugging Face (in model.layers.i); every one a .weight
    "attn_norm": "input_layernorm", "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj",
}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_HEAD, _HF_HEAD = "head.weight", "lm_head.weight"

DEFAULT_TRAINING_SEQ_LEN = 8192  # Llama 3's pre-training context, before its long-context stage
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _names(cfg: LlamaConfig) -> dict[str, str]:
    """Our parameter name -> Hugging Face tensor name, the head included (the embedding's when tied)."""
    names = dict(_TOP)
    for i in range(cfg.n_layers):
        names.update({f"layers.{i}.{ours}.weight": f"model.layers.{i}.{hf}.weight" for ours, hf in _BLOCK.items()})
    names[_HEAD] = _TOP["tok_emb.weight"] if cfg.tie_embeddings else _HF_HEAD
    return names


def to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict (a tied head may be listed or not) -> a ``LlamaForCausalLM`` state dict."""
    out = {hf: state[ours] for ours, hf in _names(cfg).items() if ours != _HEAD}
    if not cfg.tie_embeddings:
        out[_HF_HEAD] = state[_HEAD]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(name: str, cfg: LlamaConfig) -> tuple[tuple[str, ...], Callable[[torch.Tensor], torch.Tensor]]:
    """The ``LlamaForCausalLM`` tensor our parameter ``name`` is (the inverse of ``to_hf``)."""
    hf = _names(cfg).get(name)
    if hf is None:
        raise KeyError(f"{name} is not a parameter of the Llama 3 model")
    return (hf,), _same


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


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
    theta, rope = _rope_from_hf(config)
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


def _rope_from_hf(config: dict) -> tuple[float, dict]:
    """(rope_theta, our rope_* fields) from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``."""
    if isinstance(config.get("rope_parameters"), dict):
        key, params = "rope_parameters", config["rope_parameters"]
        if "rope_theta" not in params and params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"rope_parameters per layer type ({', '.join(params)}): this Llama has one RoPE")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        key, params = "rope_scaling", config.get("rope_scaling") or {}
        theta = config.get("rope_theta", 10000.0)  # LlamaConfig's default
    for where in (config, params):
        if float(where.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {where['partial_rotary_factor']}: this Llama rotates whole heads")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), {}
    if rope_type != "llama3":
        raise ValueError(f"{key} rope_type {rope_type!r}: this Llama computes plain RoPE (\"default\") or \"llama3\"")
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise ValueError(f"{key}: rope_type \"llama3\" needs {', '.join(missing)}")
    return float(theta), dict(rope_factor=float(params["factor"]), rope_low_freq_factor=float(params["low_freq_factor"]),
                              rope_high_freq_factor=float(params["high_freq_factor"]),
                              rope_original_context=int(params["original_max_position_embeddings"]))


def _width_rule(d_model: int, width: int) -> tuple[float | None, int]:
    """The width rule's inputs (ffn_dim_multiplier, multiple_of) of a named size of this shape, so that an
    override of d_model recomputes the width that size's way; Meta's defaults otherwise."""
    for size in MODEL_SIZES.values():
        if (size.d_model, size.mlp_width) == (d_model, width):
            return size.ffn_dim_multiplier, size.multiple_of
    return None, DEFAULT_MULTIPLE_OF
