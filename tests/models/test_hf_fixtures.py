"""Hugging Face checked against Hugging Face: tiny folders that transformers itself wrote (tests/fixtures/hf-models/,
copied from shared/fixtures/hf-models/, whose README says how they were made), read by the engine's own reader
(runtime/checkpoint/hf_weights.py), run by the engine's model in fp32, and compared with what transformers computed
(``expected.json``): the loss and the first logits within 1e-5, the 16 greedy ids exactly, through both the plain
forward and ``run.py generate`` (KV cache). No code of ours wrote these numbers, so a convention error (RoPE layout,
GQA mapping, Conv1D transposes, q/k/v order, norms, tied heads) fails here.

A family is one row of ``FAMILY_OF``: every fixture folder present must have one (a folder without a row fails),
and each row's folder must be present. The hand-written reference forwards the other tests use on folders of other
shapes (tests/models/gpt2/test_hf.py, tests/models/llama3/test_llama3_hf.py) are checked against the same numbers here.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from models import generate, parameter_count
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.commands import generate as generate_command
from runtime.commands.generate import build
from tests.hf_folders import read_folder, reference_config_4x
from tests.hf_reference import parse_safetensors
from tests.models.gpt2.test_hf import gpt2_forward
from tests.models.llama3.test_llama3_hf import llama_forward
from tests.models.test_generation import full_sequence_greedy
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "hf-models"

# Fixture folder -> the engine family that must read it.
FAMILY_OF = {"gpt2": "gpt2", "llama3": "llama3", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "mixtral": "mixtral",
             "deepseek-v3": "deepseek_v3", "deepseek-v3-yarn": "deepseek_v3", "deepseek-v3-yarn-mscale": "deepseek_v3",
             "deepseek-v3-fp8": "deepseek_v3", "gpt-oss": "gpt_oss", "gpt-oss-mxfp4": "gpt_oss"}

# Hand-written forwards of a folder's tensors (Hugging Face names) and config.json, where a family has one.
REFERENCE_FORWARDS: dict[str, Callable[[dict, dict, torch.Tensor], torch.Tensor]] = {
    "gpt2": gpt2_forward,
    "llama3": lambda tensors, config, tokens: llama_forward(tensors, reference_config_4x(config), tokens),
}

# fixtures/README.md: logits reach about 7; transformers' own sdpa and eager attention differ by up to 6e-6.
ATOL, RTOL = 1e-5, 1e-5

# Folders copied before their family exists here, for tests that read them as files (runtime/checkpoint/quantized/:
# its codecs and reader against the released layouts): a family's arrival moves its folders from here to FAMILY_OF.
AWAITING_FAMILY: set[str] = set()

PRESENT = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file() and p.name not in AWAITING_FAMILY)
# Folders stored in a released quantized layout (config.json's quantization_config): read dequantized, so their
# logits and ids are checked here; their stored tensors and the layout written back, in
# tests/runtime/checkpoint/quantized/.
PLAIN = [n for n in PRESENT if "quantization_config" not in json.loads((FIXTURES / n / "config.json").read_text())]


def _expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _engine_model(name: str):
    """The engine's model of the folder, read by the engine's reader (both copies of a tied weight)."""
    hf = read_hf_model(FIXTURES / name)
    return hf, build(hf.config, read_state_dict(check_weights(hf), hf.config))


def test_every_fixture_folder_has_a_family_and_every_family_its_folder():
    assert set(PRESENT) == set(FAMILY_OF), ("add a FAMILY_OF row for each folder of tests/fixtures/hf-models/ (and "
                                            "copy the folder of each row)")
    assert not AWAITING_FAMILY & set(FAMILY_OF), "a folder with a FAMILY_OF row no longer awaits its family"


@pytest.mark.parametrize("name", PLAIN)
def test_the_reader_finds_the_family_and_every_tensor_of_the_file(name):
    expected = _expected(name)
    hf = read_hf_model(FIXTURES / name, mtp_depth=0)  # transformers' model: no multi-token-prediction depth
    assert hf.spec.family == FAMILY_OF[name]
    weights = check_weights(hf)
    assert weights.unused == ()  # every tensor transformers saved is one the model reads
    assert {n: math.prod(weights.folder.info(n).shape) for n in weights.folder.names()} == expected["param_counts"]
    assert parameter_count(hf.config) == expected["model_num_parameters"]  # a tied weight counted once


@pytest.mark.parametrize("name", PRESENT)
def test_loss_and_first_logits_are_transformers(name):
    expected = _expected(name)
    _, model = _engine_model(name)
    batch = torch.tensor(expected["batch"])  # (2, 24)
    with torch.no_grad():
        logits = model(batch)  # (2, 24, V), fp32
    torch.testing.assert_close(logits[0, :4], torch.tensor(expected["logits_row0_pos0to3"]), atol=ATOL, rtol=RTOL)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()
    assert loss == pytest.approx(expected["loss"], abs=ATOL, rel=RTOL)


@pytest.mark.parametrize("name", PRESENT)
def test_greedy_ids_are_transformers_with_and_without_the_cache(name):
    expected = _expected(name)
    hf, model = _engine_model(name)
    prompt, want = torch.tensor([expected["prompt"]]), expected["greedy_new_ids"]
    assert full_sequence_greedy(model, prompt, len(want))[0].tolist() == want  # a forward per token, as transformers
    assert generate(model, prompt, n_layers=hf.config.n_layers, max_new_tokens=len(want))[0].tolist() == want


@pytest.mark.parametrize("name", PRESENT)
def test_run_py_generate_on_the_folder_gives_transformers_greedy_ids(name, run_main):
    expected = _expected(name)
    run = run_main(generate_command.main, ["--init-from", FIXTURES / name, "--prompt-ids", ",".join(map(str, expected["prompt"])),
                                           "--max-new-tokens", len(expected["greedy_new_ids"]), "--temperature", 0])
    assert run.code == 0, run.err
    assert run.last_json()["new_ids"] == expected["greedy_new_ids"]


@pytest.mark.parametrize("name", PLAIN)
def test_the_adapter_writes_the_files_tensors_and_config_back(name):
    hf = read_hf_model(FIXTURES / name, mtp_depth=0)  # transformers saves no multi-token-prediction depth
    ours = read_state_dict(check_weights(hf), hf.config)
    written = hf.spec.hf.to_hf(ours, hf.config)
    _, _, saved = parse_safetensors(FIXTURES / name / "model.safetensors")  # the reference parser
    assert sorted(written) == sorted(saved)
    for hf_name, (dtype, shape, raw) in saved.items():
        assert dtype == "F32" and list(written[hf_name].shape) == shape, hf_name
        assert bytes(written[hf_name].contiguous().flatten().view(torch.uint8).tolist()) == raw, hf_name
    assert hf.spec.hf.config_from_hf(hf.spec.hf.config_to_hf(hf.config)) == hf.config


@pytest.mark.parametrize("name", [n for n in PRESENT if FAMILY_OF.get(n) in REFERENCE_FORWARDS])
def test_the_hand_written_reference_forward_computes_transformers_logits(name):
    expected = _expected(name)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    batch = torch.tensor(expected["batch"])
    with torch.no_grad():
        logits = REFERENCE_FORWARDS[FAMILY_OF[name]](read_folder(FIXTURES / name), config, batch)
    torch.testing.assert_close(logits[0, :4], torch.tensor(expected["logits_row0_pos0to3"]), atol=ATOL, rtol=RTOL)
