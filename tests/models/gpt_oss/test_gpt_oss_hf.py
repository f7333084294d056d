"""gpt-oss's Hugging Face adapter (models/gpt_oss/hf.py) beyond its fixtures (tests/models/test_hf_fixtures*.py): the
released checkpoints' config.json (transformers 4.x spelling) reads to the published size, both generations read
alike, configs it would compute differently are refused naming the key; the experts are read row by row, from the
MXFP4 folder too (a rank's rows only); ``export --export-dtype mxfp4`` is refused for a family that stores nothing so."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models import named_config, parameter_shapes, spec_of
from runtime.checkpoint.hf_weights import check_weights, initial_values, read_hf_model
from runtime.checkpoint.quantized.layouts import Mxfp4Experts
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "hf-models"

# openai/gpt-oss-20b's config.json as released (transformers 4.55): rope_theta + rope_scaling, experts_per_token
# beside num_experts_per_tok, initial_context_length; its quantization_config is the folder's business.
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_the_released_config_reads_to_the_published_size():
    assert spec_of(named_config("gpt-oss-20b")).hf.config_from_hf(RELEASED_20B) == named_config("gpt-oss-20b")
    without_types = {k: v for k, v in RELEASED_20B.items() if k != "layer_types"}  # transformers' default: alternate
    assert spec_of(named_config("gpt-oss-20b")).hf.config_from_hf(without_types) == named_config("gpt-oss-20b")


@pytest.mark.parametrize("size", ["gpt-oss-debug", "gpt-oss-120b"])
def test_both_config_json_generations_read_to_the_same_config(size):
    cfg = named_config(size)
    hf = spec_of(cfg).hf
    written = hf.config_to_hf(cfg)
    assert written["rope_parameters"]["truncate"] is False and written["rope_scaling"]["truncate"] is False
    fresh = dataclasses.replace(cfg, router_init_std=0.02)
    v4 = {k: v for k, v in written.items() if k not in ("rope_parameters", "dtype")}
    v5 = {k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    assert hf.config_from_hf(v4) == hf.config_from_hf(v5) == fresh


@pytest.mark.parametrize(("change", "key"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": False}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 23}, "layer_types"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"num_local_experts": None}, "num_local_experts"),
])
def test_configs_this_model_would_compute_differently_are_refused_naming_the_key(change, key):
    config = {k: v for k, v in {**RELEASED_20B, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=key):
        spec_of(named_config("gpt-oss-20b")).hf.config_from_hf(config)


@pytest.mark.parametrize("name", ["gpt-oss", "gpt-oss-mxfp4"])
def test_a_rank_reads_only_its_experts_rows(name, monkeypatch):
    """Rows 2..3 of every expert tensor (a rank holding 2 of the 4 experts): the full tensor's rows, and an MXFP4
    tensor decodes only those rows."""
    weights = check_weights(read_hf_model(FIXTURES / name))
    values, cfg = initial_values(weights), weights.model.config
    decoded, original = [], Mxfp4Experts.read
    monkeypatch.setattr(Mxfp4Experts, "read", lambda self, folder, stored, start, stop: decoded.append(
        (start, stop)) or original(self, folder, stored, start, stop))
    experts = {n: s for n, s in parameter_shapes(cfg).items() if ".moe.experts." in n}
    assert len(experts) == 4 * cfg.n_layers and all(weights.model.spec.hf.row_wise(n) for n in experts)
    for param, shape in experts.items():
        rows = values.rows(param, shape, 2, 4)
        assert torch.equal(rows, values(param, shape)[2:4]), param
    if name == "gpt-oss-mxfp4":
        assert decoded[:2 * cfg.n_layers:2] == [(2, 4)] * cfg.n_layers  # each layer's gate_up rows, then down's ...
        assert decoded.count((2, 4)) == 2 * cfg.n_layers  # gate_up_proj and down_proj of each layer, rows 2..3


def test_export_stores_the_experts_as_the_released_mxfp4_folder_and_refuses_other_families():
    """``export --export-dtype mxfp4``'s tensors (runtime/commands/export.py) from the values the MXFP4 folder reads as:
    the folder's bytes, and its quantization_config; a family whose checkpoints store nothing so is refused."""
    from runtime.commands.export import _quantized
    from tests.hf_reference import parse_safetensors

    weights = check_weights(read_hf_model(FIXTURES / "gpt-oss-mxfp4"))
    cfg, hf = weights.model.config, weights.model.spec.hf
    values = initial_values(weights)
    tensors, quantization = _quantized(hf.to_hf({n: values(n, s) for n, s in parameter_shapes(cfg).items()}, cfg), hf,
                                       cfg.family, "mxfp4", block_size=(128, 128))
    _, _, saved = parse_safetensors(FIXTURES / "gpt-oss-mxfp4" / "model.safetensors")
    assert sorted(tensors) == sorted(saved)
    for name, (dtype, shape, raw) in saved.items():
        assert bytes(tensors[name].contiguous().flatten().view(torch.uint8).tolist()) == raw, name
    assert quantization == json.loads((FIXTURES / "gpt-oss-mxfp4" / "config.json").read_text())["quantization_config"]
    llama = named_config("llama3-debug")
    with pytest.raises(ValueError, match="--export-dtype mxfp4: a llama3 model.*families that do: gpt_oss"):
        _quantized({}, spec_of(llama).hf, llama.family, "mxfp4", block_size=(128, 128))
