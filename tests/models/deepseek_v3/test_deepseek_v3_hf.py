"""DeepSeek-V3's Hugging Face adapter (models/deepseek_v3/hf.py) beyond its transformers fixtures
(tests/models/test_hf_fixtures.py) and the checks every family's config.json passes (tests/models/test_family_hf_config.py):
the YaRN written, a q LoRA rank of null, folders of DeepseekV3ForCausalLM under another model_type (Kimi K2's), and
folders with none or part of their multi-token-prediction tensors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from models import named_config, parameter_shapes, spec_of
from runtime.checkpoint.hf_weights import check_weights, family_of, initial_values, read_hf_model
from runtime.checkpoint.safetensors import TensorFileError
from tests.hf_reference import pack, parse_safetensors, write_safetensors
from tests.paths import FIXTURE_ROOT

FIXTURE = FIXTURE_ROOT / "hf-models" / "deepseek-v3"
HF = spec_of(named_config("deepseek-v3-debug")).hf


@pytest.mark.parametrize("size", ["deepseek-v3-debug", "deepseek-v3-16b", "deepseek-v3"])
def test_config_json_holds_the_yarn_and_a_q_lora_rank_of_null_for_none(size):
    """Both generations' spellings of every size: tests/models/test_family_hf_config.py."""
    cfg = named_config(size)
    written = HF.config_to_hf(cfg)
    assert written["rope_parameters"]["rope_type"] == "yarn" and written["q_lora_rank"] == (cfg.q_lora_rank or None)


def test_without_a_q_lora_rank_the_query_is_one_q_proj():
    cfg = named_config("deepseek-v3-16b", n_layers=2)
    meta = {name: torch.empty(shape, device="meta") for name, shape in parameter_shapes(cfg).items()}
    names = HF.to_hf(meta, cfg)
    assert names["model.layers.0.self_attn.q_proj.weight"].shape == (16 * 192, 2048)
    assert not [n for n in names if "q_a_proj" in n or "q_b_proj" in n]
    assert names["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2 * 1408, 2048)  # two shared experts
    assert HF.config_from_hf({**HF.config_to_hf(cfg), "q_lora_rank": None}).q_lora_rank == 0


def test_kimi_k2s_folder_is_a_deepseek_v3_by_its_architecture():
    """Kimi K2's config.json (moonshotai/Kimi-K2-Instruct): DeepseekV3ForCausalLM under model_type kimi_k2, with the
    remote code's router keys and a YaRN of beta_fast 1; shapes shrunk."""
    config = {**HF.config_to_hf(named_config("deepseek-v3-debug")), "model_type": "kimi_k2", "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
              "moe_layer_freq": 1, "rope_parameters": None, "rope_theta": 50000.0,
              "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    assert family_of(config, Path("config.json")).family == "deepseek_v3"
    cfg = HF.config_from_hf(config)
    assert (cfg.n_group, cfg.rope_theta, cfg.rope_yarn.factor, cfg.rope_yarn.beta_fast) == (1, 50000.0, 32.0, 1.0)


def _with_mtp_tensors(tmp_path: Path, names_and_shapes) -> Path:
    folder = tmp_path / "with-mtp"
    folder.mkdir()
    shutil.copy(FIXTURE / "config.json", folder / "config.json")
    _, _, tensors = parse_safetensors(FIXTURE / "model.safetensors")
    mtp = {f"model.layers.3.{name}": ("F32", shape, pack("F32", [0.5] * math.prod(shape)))
           for name, shape in names_and_shapes}
    write_safetensors(folder / "model.safetensors", {**tensors, **mtp})
    return folder


def test_a_folder_without_multi_token_prediction_tensors_starts_its_depths_fresh():
    """num_nextn_predict_layers 1 is the model's MTP depth; transformers saves no MTP tensors (as the fixture): the
    depth starts from name-seeded values, said in one line; --mtp-depth 0 reads the model alone."""
    assert json.loads((FIXTURE / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf = read_hf_model(FIXTURE)
    assert hf.config.mtp_depth == 1 and hf.config.n_layers == 3
    weights = check_weights(hf)
    assert weights.fresh == (0,) and weights.note().count("\n") == 0
    assert "multi-token-prediction depth(s) 1" in weights.note() and "fresh values" in weights.note()
    value = initial_values(weights, seed=7)
    shapes = parameter_shapes(hf.config)
    for name in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.block.moe.experts.w1"):
        assert torch.equal(value(name, shapes[name]), spec_of(hf.config).initial_value(name, shapes[name], seed=7,
                                                                                        cfg=hf.config))
    assert torch.equal(value("mtp.embed.weight", shapes["mtp.embed.weight"]), value("tok_emb.weight",
                                                                                     shapes["tok_emb.weight"]))
    alone = check_weights(read_hf_model(FIXTURE, mtp_depth=0))
    assert alone.fresh == () and alone.note() is None and HF.config_to_hf(hf.config)["num_nextn_predict_layers"] == 1


def test_a_folder_holding_part_of_a_depth_is_refused_and_passed_over_without_mtp(tmp_path):
    """Some of layer 3's MTP tensors but not its block: the folder does not match its config (one error naming the
    depth); with --mtp-depth 0 they are tensors the model does not use."""
    parts = (("enorm.weight", [48]), ("hnorm.weight", [48]), ("eh_proj.weight", [48, 96]),
             ("shared_head.norm.weight", [48]))
    folder = _with_mtp_tensors(tmp_path, parts)
    with pytest.raises(TensorFileError, match=r"depth 1 \(model\.layers\.3\.\*\) has 4 of its \d+ tensors"):
        check_weights(read_hf_model(folder))
    weights = check_weights(read_hf_model(folder, mtp_depth=0))
    assert sorted(weights.unused) == sorted(f"model.layers.3.{n}" for n, _ in parts)
    assert "passing over 4 tensors" in weights.note()
