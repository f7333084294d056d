"""--init-from FOLDER, in one process: Hugging Face folders written by hand (tests/hf_folders.py: the published
layouts, the reference safetensors writer) read to the model their config.json describes, and that model
computes what a reference forward of the folder's tensors computes; shape flags are checked against the
folder; broken folders are one error line naming the file and the tensor, before any process group.
(Training from folders on real ranks, export back and generation from a checkpoint: tests/launches/test_hf_runs.py.)"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from models import FAMILIES
from runtime.checkpoint.hf_weights import CARRIED_FILES, carried_from, check_weights, read_hf_model, read_state_dict
from runtime.commands.generate import build
from runtime.commands.train import InputError, check_inputs
from runtime.distributed.process_group import LaunchEnv
from tests.hf_folders import gpt2_config, llama_config, read_folder, reference_config_4x, write_folder
from tests.launch import check_clean_failure
from tests.models.gpt2.test_hf import gpt2_forward
from tests.models.llama3.test_llama3_hf import llama_forward
from tests.paths import FIXTURE_ROOT

ENV = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
FIXTURES = FIXTURE_ROOT / "hf-models"  # written by transformers
HF_GPT2 = FAMILIES["gpt2"].hf
N_POS = 32

# name: (config, write_folder options)
FOLDERS = {
    "gpt2-tied": (gpt2_config(n_positions=N_POS), {}),
    # untied, bf16, 3 shards, and the causal-mask buffers older GPT-2 checkpoints hold (passed over)
    "gpt2-untied-bf16-sharded": (gpt2_config(n_positions=N_POS, tied=False),
                                 dict(dtype="BF16", shards=3, extra={f"transformer.h.{i}.attn.bias": [1, 1, N_POS, N_POS]
                                                                     for i in range(4)})),
    # saved from GPT2Model (the base model): "wte.weight", "h.0.ln_1.weight", ... as openai-community/gpt2 is
    "gpt2-base-model-names": (gpt2_config(n_positions=N_POS), dict(drop_prefix=True)),
    "llama-4x-tied": (llama_config(generation=4), {}),
    "llama-5x-untied-head-dim-sharded": (llama_config(generation=5, heads=4, kv_heads=1, head_dim=24, tied=False),
                                         dict(shards=2)),
    "llama-4x-plain-rope-fp16": (llama_config(generation=4, llama3_scaling=False), dict(dtype="F16")),
}


def _folder(tmp_path, name: str, **changes):
    config, options = FOLDERS[name]
    return write_folder(tmp_path / name, config, **{**options, **changes})


def _error(argv: list[str]) -> str:
    with pytest.raises(InputError) as raised:
        check_inputs(argv, ENV)
    line = f"error: {raised.value}"
    assert "\n" not in line
    return line


def reference_logits(config: dict, tensors: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Hugging Face's forward written from its layout, on the folder's tensors (read by the reference parser)."""
    if config["model_type"] == "gpt2":
        if "transformer.wte.weight" not in tensors:  # a base model's names
            tensors = {(n if n.startswith("lm_head") else f"transformer.{n}"): t for n, t in tensors.items()}
        return gpt2_forward(tensors, {"tie_word_embeddings": True, **config}, tokens)
    return llama_forward(tensors, reference_config_4x(config), tokens)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_a_folder_reads_to_its_model_which_computes_the_reference_logits(tmp_path, name):
    folder = _folder(tmp_path, name)
    cfg, _, start = check_inputs(["--init-from", str(folder.path), "--steps", "1"], ENV)
    config = folder.config
    assert cfg.model.family == ("gpt2" if config["model_type"] == "gpt2" else "llama3")
    assert (cfg.model.n_layers, cfg.model.vocab_size) == (4, 256) and cfg.model_name == name
    assert cfg.model.tie_embeddings == config.get("tie_word_embeddings", True)
    if "bias" in json.dumps(FOLDERS[name][1]):
        assert "passing over 4 tensors the model does not use (transformer.h.0.attn.bias" in start.notes[0]
    weights = check_weights(read_hf_model(folder.path))
    model = build(cfg.model, read_state_dict(weights, cfg.model))
    tokens = torch.randint(0, 256, (2, N_POS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference_logits(config, read_folder(folder.path), tokens)
        # fp32 sums in another order: differences relative to the logits' scale (tens, with these weights)
        torch.testing.assert_close(model(tokens), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_a_pytorch_model_bin_folder_reads_like_its_safetensors(tmp_path):
    folder = _folder(tmp_path, "llama-4x-tied")
    tensors = read_folder(folder.path)
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    (bin_folder / "config.json").write_text(json.dumps(folder.config))
    torch.save(tensors, bin_folder / "pytorch_model.bin")  # what save_pretrained(safe_serialization=False) writes
    cfg, _, _ = check_inputs(["--init-from", str(bin_folder), "--steps", "1"], ENV)
    state = read_state_dict(check_weights(read_hf_model(bin_folder)), cfg.model)
    assert torch.equal(state["layers.1.attn.k.weight"], tensors["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(state["head.weight"], tensors["model.embed_tokens.weight"])  # tied


def test_a_shorter_seq_len_keeps_the_models_context_and_every_shape_of_the_folder():
    # transformers' own 256-position GPT-2 (tests/fixtures/hf-models/gpt2) trained on windows of 64 tokens
    folder = FIXTURES / "gpt2"
    cfg, _, _ = check_inputs(["--init-from", str(folder), "--steps", "1", "--seq-len", "64"], ENV)
    assert (cfg.model.seq_len, cfg.model.context, cfg.model.n_positions) == (64, 256, 256)
    state = read_state_dict(check_weights(read_hf_model(folder)), cfg.model)
    tensors = read_folder(folder)
    assert torch.equal(state["pos_emb.weight"], tensors["transformer.wpe.weight"])  # all 256 rows
    written = HF_GPT2.to_hf(state, cfg.model)
    assert {n: t.shape for n, t in written.items()} == {n: t.shape for n, t in tensors.items()}
    assert HF_GPT2.config_to_hf(cfg.model)["n_positions"] == 256
    line = _error(["--init-from", str(folder), "--steps", "1", "--seq-len", "257"])
    assert "--seq-len 257" in line and "has 256 positions" in line and "1 to 256" in line, line


def test_an_export_carries_the_source_folders_token_ids_and_generation_config(tmp_path):
    # An Instruct model's eos list, in a copy of the folder transformers wrote.
    folder = tmp_path / "instruct"
    shutil.copytree(FIXTURES / "gpt2", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 7], "pad_token_id": 3}))
    carried = carried_from(str(folder))
    assert carried.config == {"bos_token_id": 0, "eos_token_id": [0, 7], "pad_token_id": 3} and carried.note is None
    assert CARRIED_FILES == ("generation_config.json",) and carried.files == {
        "generation_config.json": (FIXTURES / "gpt2" / "generation_config.json").read_bytes()}
    (tmp_path / "model.pt").write_bytes(b"")
    for scratch_or_export in (None, str(tmp_path / "model.pt")):  # the family's defaults stand
        assert carried_from(scratch_or_export) == type(carried)({}, {})
    gone = carried_from(str(tmp_path / "moved-away"))
    assert (gone.config, gone.files) == ({}, {}) and "moved-away, which cannot be read here" in gone.note


@pytest.mark.parametrize(("flags", "words"), [
    (["--model", "small"], ["--model small does not fit", "n_layers 4 there, 12 in --model small", "drop --model"]),
    (["--model", "llama3-debug"], ["--model llama3-debug is a llama3 model", "holds a gpt2 model", "drop --model"]),
    (["--layers", "6"], ["--layers 6", "has n_layers 4", "drop --layers"]),
    (["--vocab-size", "512"], ["--vocab-size 512", "has vocab_size 256"]),
    (["--seq-len", "64"], ["--seq-len 64", f"has {N_POS} positions", f"1 to {N_POS}"]),
    (["--untie-embeddings"], ["--untie-embeddings", "ties its embeddings", "drop --untie-embeddings"]),
])
def test_shape_flags_that_contradict_the_folder_are_an_error(tmp_path, flags, words):
    folder = _folder(tmp_path, "gpt2-tied")
    line = _error(["--init-from", str(folder.path), "--steps", "1", *flags])
    for word in words:
        assert word in line, line


def test_shape_flags_that_agree_with_the_folder_are_accepted(tmp_path):
    folder = _folder(tmp_path, "llama-4x-tied")
    cfg, _, _ = check_inputs(["--init-from", str(folder.path), "--steps", "1", "--model", "llama3-debug", "--layers",
                              "4", "--kv-heads", "2", "--seq-len", "32"], ENV)
    assert (cfg.model_name, cfg.model.n_layers, cfg.model.seq_len, cfg.model.rope_original_context) == \
        ("llama3-debug", 4, 32, 16)
    # and the GPT-2 Large command line with a GPT-2 Large folder: --model large agrees with it
    large = gpt2_config(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257)
    path = tmp_path / "large"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(large))
    assert read_hf_model(path).config == check_inputs(["--steps", "1", "--model", "large", "--skip-memory-check"], ENV)[0].model


# ---- broken folders: one error line naming the file and the tensor, before any process group ----

def _truncate(folder):
    file = folder.path / "model-00002-of-00002.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)
    return [f"{file}: truncated", "tensor 'lm_head.weight'"]


def _first_tensor_dtype(file, dtype: str) -> str:
    """Rewrite the dtype of the header's first tensor (an F32 one) to ``dtype`` of the same length, so that
    every offset still holds; returns the tensor's name."""
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = bytes(data[8:8 + n]).replace(b'"F32"', f'"{dtype}"'.encode(), 1)
    assert len(header) == n
    file.write_bytes(bytes(data[:8]) + header + bytes(data[8 + n:]))
    return next(k for k in json.loads(header) if k != "__metadata__")


def _unknown_dtype(folder):
    file = folder.path / "model.safetensors"
    name = _first_tensor_dtype(file, "Q99")
    return [str(file), f"tensor {name!r}", "dtype 'Q99'"]


CASES = {
    "truncated-shard": ("llama-5x-untied-head-dim-sharded", {}, _truncate),
    "unknown-dtype": ("gpt2-tied", {}, _unknown_dtype),
    "wrong-shape": ("gpt2-tied", dict(extra={"transformer.h.2.attn.c_attn.weight": [192, 64]}),
                    lambda f: [f"{f.path / 'model.safetensors'}: tensor 'transformer.h.2.attn.c_attn.weight' has shape "
                               "[192, 64]", "makes it [64, 192]"]),
    "missing-tensor": ("llama-4x-tied", {}, None),
    "unknown-architecture": ("llama-4x-tied", {}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_folder_is_one_error_line_naming_the_file_and_the_tensor(tmp_path, case):
    name, changes, breaker = CASES[case]
    folder = _folder(tmp_path, name, **changes)
    if case == "missing-tensor":
        config = {**folder.config, "num_hidden_layers": 5}  # layer 4 has no tensors in the folder
        (folder.path / "config.json").write_text(json.dumps(config))
        words = [f"{folder.path / 'model.safetensors'}: no tensor 'model.layers.4.input_layernorm.weight'"]
    elif case == "unknown-architecture":
        config = {**folder.config, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
        (folder.path / "config.json").write_text(json.dumps(config))
        words = [f"{folder.path / 'config.json'}: architectures ['MistralForCausalLM']", "GPT2LMHeadModel",
                 "LlamaForCausalLM"]
    else:
        words = breaker(folder)
    line = _error(["--init-from", str(folder.path), "--steps", "1"])
    for word in words:
        assert word in line, line


def test_an_integer_tensor_is_refused(tmp_path):
    folder = _folder(tmp_path, "gpt2-tied")
    name = _first_tensor_dtype(folder.path / "model.safetensors", "I32")
    line = _error(["--init-from", str(folder.path), "--steps", "1"])
    assert f"{folder.path / 'model.safetensors'}: tensor {name!r} is int32, not a floating-point type" in line, line


@pytest.mark.slow
def test_a_truncated_folder_ends_every_rank_before_any_process_group(tmp_path):
    folder = _folder(tmp_path, "llama-5x-untied-head-dim-sharded")
    words = _truncate(folder)
    check_clean_failure(2, ["--init-from", str(folder.path), "--steps", "1", "--dp", "2"], words)
