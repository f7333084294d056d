"""``config.json`` keys the decoder families share, both ways, in transformers 4.x and 5.x spellings.

transformers 5 writes ``rope_parameters`` ({"rope_theta", "rope_type", ...}), ``dtype`` and (Qwen3-MoE)
``num_local_experts``; 4.x wrote ``rope_theta`` + ``rope_scaling``, ``torch_dtype`` and ``num_experts``. Reading
takes either. Writing gives both spellings, equal: each version reads its own keys and ignores the other's
(a 4.x reader of a 5.x-only file would silently fall back to its defaults: RoPE base 10,000, 128 experts).

A config Hugging Face reads but these models would compute differently (another activation, biases, another
RoPE type, partial rotary dimensions, sliding windows) is refused with a ValueError naming the key.

YaRN's parameters (rope_type "yarn", models/common/rope.py ``YaRN``) are read as transformers 5 reads them: ``factor``
(when absent, max_position_embeddings / original_max_position_embeddings), ``original_max_position_embeddings``,
``beta_fast`` / ``beta_slow`` (32 / 1 when absent or 0), ``mscale``, ``mscale_all_dim``, ``attention_factor`` and
``truncate`` (true when absent); they are written back as given (a key absent stays absent, ``truncate`` only when false).
"""

from __future__ import annotations

from typing import Any

from models.common.rope import YaRN

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_ROPE_KEYS = ("original_max_position_embeddings",)


def rope_from_hf(config: dict, *, rope_types: tuple[str, ...] = ("default",)) -> tuple[float, dict]:
    """(rope_theta, the scaling's fields of our configs: the llama3 scaling's ``rope_factor`` ..., or YaRN's
    ``rope_yarn``; empty for plain RoPE) from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``;
    ``rope_types``: the RoPE types the family computes."""
    if isinstance(config.get("rope_parameters"), dict):
        key, params = "rope_parameters", config["rope_parameters"]
        if "rope_theta" not in params and params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"rope_parameters per layer type ({', '.join(params)}): this model has one RoPE")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        key, params = "rope_scaling", config.get("rope_scaling") or {}
        theta = config.get("rope_theta", 10000.0)  # transformers' default
    for where in (config, params):
        if float(where.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {where['partial_rotary_factor']}: this model rotates whole heads")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in rope_types:
        computed = " or ".join(f'"{t}"' for t in rope_types)
        raise ValueError(f"{key} rope_type {rope_type!r}: this model computes {computed} RoPE")
    if rope_type == "default":
        return float(theta), {}
    missing = [k for k in (YARN_ROPE_KEYS if rope_type == "yarn" else LLAMA3_ROPE_KEYS) if k not in params]
    if missing:
        raise ValueError(f"{key}: rope_type \"{rope_type}\" needs {', '.join(missing)}")
    if rope_type == "yarn":
        return float(theta), {"rope_yarn": _yarn_from_hf(params, config.get("max_position_embeddings"), key=key)}
    return float(theta), dict(rope_factor=float(params["factor"]), rope_low_freq_factor=float(params["low_freq_factor"]),
                              rope_high_freq_factor=float(params["high_freq_factor"]),
                              rope_original_context=int(params["original_max_position_embeddings"]))


def _yarn_from_hf(params: dict, context: int | None, *, key: str) -> YaRN:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        if context is None:
            raise ValueError(f"{key}: rope_type \"yarn\" needs factor (or max_position_embeddings)")
        factor = context / original
    optional = {name: float(params[name]) for name in ("mscale", "mscale_all_dim", "attention_factor")
                if params.get(name) is not None}
    return YaRN(factor=float(factor), original_context=original, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)), **optional)


def plain_rope_to_hf(theta: float) -> dict:
    return {"rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}


def rope_to_hf(theta: float, yarn: YaRN | None) -> dict:
    """Plain RoPE or YaRN in both spellings: 4.x ``rope_theta`` + ``rope_scaling``, 5.x ``rope_parameters``."""
    if yarn is None:
        return plain_rope_to_hf(theta)
    scaling = {"rope_type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_context,
               "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
               **{name: getattr(yarn, name) for name in ("mscale", "mscale_all_dim", "attention_factor")
                  if getattr(yarn, name) is not None},
               **({} if yarn.truncate else {"truncate": False})}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {"rope_theta": theta, **scaling}}


def dtype_to_hf(dtype: str = "float32") -> dict:
    return {"torch_dtype": dtype, "dtype": dtype}


def refuse(config: dict, **computed: Any) -> None:
    """ValueError naming the first key whose value (when present and not None) is not the one these models compute."""
    for key, value in computed.items():
        if config.get(key) not in (None, value):
            raise ValueError(f"{key} {config[key]!r}: this model computes {key} {value!r}")


def first(config: dict, *keys: str) -> Any:
    """The value of the first of ``keys`` present (and not None): one setting under two versions' names."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise KeyError(keys[0])


def shape_from_hf(config: dict) -> dict:
    """The attention and vocabulary shape every family shares: our config fields from config.json."""
    d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return dict(n_layers=int(config["num_hidden_layers"]), d_model=d, n_heads=heads,
                n_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or d // heads), vocab_size=int(config["vocab_size"]),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def shape_to_hf(cfg: Any) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": cfg.tie_embeddings}
