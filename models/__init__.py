"""The model families, one registry entry each; everything outside ``models/`` goes through here.

Adding a family is one folder exporting a ``ModelSpec`` (models/spec.py) and one entry in ``FAMILIES``.
A config names its family (``cfg.family``), so ``spec_of(cfg)`` finds everything else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from models import deepseek_v3, gpt2, gpt_oss, llama3, mixtral, qwen3, qwen3_moe
from models.common.attention_core import CausalAttention, SinkAttention, any_length_kernels, document_runs
from models.common.banded_attention import (
    BANDED_ATTENTION_FLOPS,
    KEY_BLOCK,
    banded_attention,
    default_chunk,
    visible_keys,
)
from models.common.grouped_mm import GROUPED_MM_FLOPS, grouped_mm
from models.common.latent_attention import LatentKeys
from models.common.load_balance import BalanceLoss, update_expert_bias
from models.common.moe import GroupedExperts, MoE, experts_swiglu, inactive_expert_parameters
from models.common.mtp import (
    MTP,
    MTP_EMBEDDING,
    MTP_HF_COPIES,
    mtp_block_names,
    mtp_depth,
    mtp_hf_prefix,
    mtp_model_plan,
    mtp_moe_names,
    with_multi_token_prediction,
    without_mtp,
)
from models.generation import generate
from models.kv_cache import KVCache
from models.spec import MOE, TOKEN_EMBEDDING, ModelSpec

# Every family may train with multi-token prediction: its spec builds, initialises and names the depths too.
FAMILIES: dict[str, ModelSpec] = {spec.family: with_multi_token_prediction(spec)
                                  for spec in (gpt2.SPEC, llama3.SPEC, qwen3.SPEC, qwen3_moe.SPEC, mixtral.SPEC,
                                               deepseek_v3.SPEC, gpt_oss.SPEC)}

# Every named size of every family: the ``--model`` choices.
MODEL_NAMES: dict[str, tuple[ModelSpec, Any]] = {
    name: (spec, cfg) for spec in FAMILIES.values() for name, cfg in spec.sizes.items()}
assert len(MODEL_NAMES) == sum(len(s.sizes) for s in FAMILIES.values()), "two families name a size alike"


def spec_of(cfg: Any) -> ModelSpec:
    return FAMILIES[cfg.family]


def named_config(name: str, **overrides: Any) -> Any:
    """The config of size ``name`` (a ``--model`` choice) with flag-style overrides (``n_layers=...``)."""
    spec, base = MODEL_NAMES[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    return spec.with_overrides(base, **given) if given else base


def with_window(cfg: Any, seq_len: int) -> Any:
    """An existing model (a Hugging Face folder's, a checkpoint's) trained or evaluated on windows of ``seq_len``
    tokens: its context and every parameter shape stay (GPT-2's position table keeps all its rows). ValueError
    when the window is longer than the context (``cfg.context``: GPT-2's n_positions, Llama's
    max_position_embeddings)."""
    if seq_len > cfg.context:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's context of {cfg.context} positions; "
                         f"valid --seq-len values: 1 to {cfg.context}")
    return dataclasses.replace(cfg, seq_len=seq_len)


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> Any:
    """The inverse of ``config_to_dict`` (checkpoint manifests record it); a dict without a family is GPT-2,
    as every checkpoint written before families existed."""
    d = dict(d)
    spec = FAMILIES[d.pop("family", "gpt2")]
    return spec.config_from_dict(d) if spec.config_from_dict else spec.config_type(**d)


def build_model(cfg: Any, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model with its name-seeded initial values (the single-process reference, the plain loop)."""
    spec = spec_of(cfg)
    with torch.device(device):
        model = spec.build(cfg)
    init_weights(model, seed=seed, cfg=cfg)
    return model


def init_weights(model: nn.Module, *, seed: int, cfg: Any) -> None:
    """Initialise every parameter of ``model`` (the whole model or a part keeping its names)."""
    initial_value = spec_of(cfg).initial_value
    for name, param in model.named_parameters():
        value = initial_value(name, tuple(param.shape), seed=seed, cfg=cfg)
        with torch.no_grad():
            param.copy_(value.to(dtype=param.dtype, device=param.device))


def parameter_count(cfg: Any) -> int:
    """Parameters of the model, a tied weight counted once (GPT-2 small: 124,439,808); a router's selection bias
    (not trained) is not counted."""
    with torch.device("meta"):
        return sum(p.numel() for p in spec_of(cfg).build(cfg).parameters() if p.requires_grad)


def activated_parameter_count(cfg: Any) -> int:
    """Parameters one token uses: all of a dense model's; a mixture's less the routed experts it does not visit
    ((E - k) / E of each MoE block's experts). Embeddings and head included, as model cards count (Qwen3-30B-A3B:
    3.3B of 30.5B)."""
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg)
        return sum(p.numel() for p in model.parameters() if p.requires_grad) - inactive_expert_parameters(model)


def parameter_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter name the engine keeps (a tied head copy included) and its shape."""
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}


def mixture_of_experts_families() -> list[str]:
    """The families whose models have mixture-of-experts blocks (as their debug sizes do), for messages."""
    return [family for family, spec in FAMILIES.items() if MOE in spec.block_kinds(spec.sizes[spec.debug_size])]


def moe_layer_names(cfg: Any) -> list[str]:
    """The model's mixture-of-experts modules ("layers.3.moe"), in order, then its MTP depths' ("mtp.layers.0.block.moe");
    none in a dense model."""
    spec = spec_of(cfg)
    return [f"layers.{i}.moe" for i, kind in enumerate(spec.block_kinds(cfg)) if kind == MOE] + mtp_moe_names(spec, cfg)


def tied_weights(cfg: Any) -> dict[str, str]:
    """{copy: source} of the weights the model uses in two places: a tied head's (``tie_embeddings``) and the MTP
    depths' embedding, both the token embedding's. One Parameter in the whole model; copies kept equal where a
    pipeline puts them on other stages (runtime/engine/tied.py)."""
    tied = dict(spec_of(cfg).tied_weights) if cfg.tie_embeddings else {}
    return {**tied, **({f"{MTP_EMBEDDING}.weight": f"{TOKEN_EMBEDDING}.weight"} if mtp_depth(cfg) else {})}


def flops_per_token(cfg: Any) -> float:
    return spec_of(cfg).flops_per_token(cfg)


__all__ = ["BANDED_ATTENTION_FLOPS", "BalanceLoss", "CausalAttention", "FAMILIES", "GROUPED_MM_FLOPS", "GroupedExperts",
           "KEY_BLOCK", "KVCache", "LatentKeys", "MODEL_NAMES", "MTP", "MTP_EMBEDDING", "MTP_HF_COPIES", "MoE", "ModelSpec",
           "SinkAttention", "activated_parameter_count", "any_length_kernels", "banded_attention", "build_model",
           "config_from_dict", "config_to_dict", "default_chunk", "document_runs", "experts_swiglu", "flops_per_token",
           "generate", "grouped_mm", "init_weights", "mixture_of_experts_families", "moe_layer_names", "mtp_block_names",
           "mtp_depth", "mtp_hf_prefix", "mtp_model_plan", "named_config", "parameter_count", "parameter_shapes", "spec_of",
           "tied_weights", "update_expert_bias", "visible_keys", "with_window", "without_mtp"]
