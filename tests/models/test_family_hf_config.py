"""config.json both ways for every registered family: every named size reads back from each transformers generation's
spelling (4.x: ``rope_theta`` + ``rope_scaling``, whose kind was ``type`` before ``rope_type``, and ``torch_dtype``; 5.x:
``rope_parameters`` and ``dtype``), and a config the model would compute differently is refused with the key named
(the cases of ``REFUSED``, rows per family)."""

from __future__ import annotations

import pytest

from models import FAMILIES, MODEL_NAMES
from tests.models.family_configs import as_read_from_hf, debug_config

# Keys transformers 5 renamed besides RoPE's and the dtype's, per family: {4.x name: 5.x name}.
RENAMED_IN_5X = {"qwen3_moe": {"num_experts": "num_local_experts"}}


def _rope_parameters(written: dict) -> dict | None:
    """A written config's RoPE as 5.x ``rope_parameters``, whichever spelling it holds; None without RoPE (GPT-2)."""
    if isinstance(written.get("rope_parameters"), dict):
        return written["rope_parameters"]
    if "rope_theta" not in written:
        return None
    return {"rope_theta": written["rope_theta"], "rope_type": "default", **(written.get("rope_scaling") or {})}


def as_4x(written: dict, family: str, *, kind: str = "rope_type") -> dict:
    """``written`` as transformers 4.x wrote it, from its documentation: ``rope_theta`` and a ``rope_scaling`` (None
    for plain RoPE) whose kind is ``kind`` ("type" before 4.45), ``torch_dtype``, the 4.x key names."""
    to_4x = {new: old for old, new in RENAMED_IN_5X.get(family, {}).items()}
    config = {to_4x.get(k, k): v for k, v in written.items() if k not in ("rope_parameters", "dtype", "torch_dtype")}
    rope = _rope_parameters(written)
    if rope is not None:
        scaling = {(kind if k == "rope_type" else k): v for k, v in rope.items() if k != "rope_theta"}
        config.update(rope_theta=rope["rope_theta"], rope_scaling=None if scaling == {kind: "default"} else scaling)
    return {**config, "torch_dtype": "bfloat16"}


def as_5x(written: dict, family: str) -> dict:
    """``written`` as transformers 5.x writes it: ``rope_parameters``, ``dtype``, the 5.x key names."""
    to_5x = RENAMED_IN_5X.get(family, {})
    dropped = ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")
    config = {to_5x.get(k, k): v for k, v in written.items() if k not in dropped}
    rope = _rope_parameters(written)
    return {**config, **({"rope_parameters": rope} if rope else {}),
            "dtype": written.get("dtype", written.get("torch_dtype", "float32"))}


@pytest.mark.parametrize("size", list(MODEL_NAMES))
def test_both_config_json_generations_read_to_the_same_config(size):
    spec, cfg = MODEL_NAMES[size]
    written = spec.hf.config_to_hf(cfg)
    # A setting written in both generations' spellings is written equal: each version reads only its own keys.
    if "rope_parameters" in written and "rope_theta" in written:
        assert _rope_parameters({k: v for k, v in written.items() if k != "rope_parameters"}) == written["rope_parameters"]
    if "dtype" in written and "torch_dtype" in written:
        assert written["dtype"] == written["torch_dtype"]
    for old, new in RENAMED_IN_5X.get(spec.family, {}).items():
        assert written.get(old, written.get(new)) == written.get(new, written.get(old)), (old, new)
    family = spec.family
    for config in (written, as_4x(written, family), as_4x(written, family, kind="type"), as_5x(written, family)):
        assert spec.hf.config_from_hf(config) == as_read_from_hf(cfg)


# Changes to each family's debug config.json that the model would compute differently, and the key the refusal names;
# a change to None removes the key (in both generations' spellings).
REFUSED = {
    "gpt2": [
        ({"activation_function": "relu"}, "activation_function"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ({"n_layer": None}, "n_layer"),
    ],
    "llama3": [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ],
    "qwen3": [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ],
    "qwen3_moe": [
        ({"num_local_experts": None}, "num_local_experts"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
    "mixtral": [
        ({"sliding_window": 4096}, "sliding_window"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ],
    "deepseek_v3": [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}}, "rope_parameters"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
    "gpt_oss": [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": False}, "attention_bias"),
        ({"layer_types": ["sliding_attention", "local_attention", "full_attention", "full_attention"]}, "layer_types"),
        ({"num_local_experts": None}, "num_local_experts"),
    ],
}
REFUSED_CASES = [(family, change, key) for family, cases in REFUSED.items() for change, key in cases]


def test_every_family_has_refused_config_cases():
    assert set(REFUSED) == set(FAMILIES)


@pytest.mark.parametrize(("family", "change", "key"), REFUSED_CASES, ids=[f"{f}-{k}" for f, _, k in REFUSED_CASES])
def test_configs_the_model_would_compute_differently_are_refused_naming_the_key(family, change, key):
    spec = FAMILIES[family]
    renamed = RENAMED_IN_5X.get(family, {})
    removed = {k for k, v in change.items() if v is None}
    removed |= {renamed[k] for k in removed if k in renamed} | {old for old, new in renamed.items() if new in removed}
    config = {k: v for k, v in {**spec.hf.config_to_hf(debug_config(spec)), **change}.items() if k not in removed}
    with pytest.raises(ValueError, match=key):
        spec.hf.config_from_hf(config)
