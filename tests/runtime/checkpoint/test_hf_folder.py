"""Hugging Face model folders: every weights layout read lazily (reference safetensors from
tests/hf_reference.py, ``.bin`` from torch.save), written back single and sharded, and every broken
folder an error naming the file and the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from runtime.checkpoint.files import CheckpointError
from runtime.checkpoint.hf_folder import HFFolder, TensorFileError, write_hf_folder
from tests import hf_reference as ref

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
          "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "tie_word_embeddings": False}
# name -> (dtype, shape, values); bf16 values exactly representable
WEIGHTS = {
    "model.embed_tokens.weight": ("BF16", [4, 2], [0.5, -1.0, 2.0, 0.25, -0.125, 3.0, 1.5, -2.0]),
    "model.layers.0.self_attn.q_proj.weight": ("F32", [2, 2], [0.1, 0.2, 0.3, 0.4]),
    "model.layers.0.input_layernorm.weight": ("F32", [2], [1.0, 1.0]),
    "model.norm.weight": ("F16", [2], [0.5, 2.0]),
    "lm_head.weight": ("BF16", [4, 2], [1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0]),
    "step": ("I64", [], [7]),
}
TORCH_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "I64": torch.int64}
SHARDS = [["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
          ["model.layers.0.input_layernorm.weight", "model.norm.weight"], ["lm_head.weight", "step"]]


def raw_of(name: str) -> bytes:
    dtype, _, values = WEIGHTS[name]
    return ref.pack(dtype, values)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def torch_tensor(name: str) -> torch.Tensor:
    dtype, shape, _ = WEIGHTS[name]
    return torch.frombuffer(bytearray(raw_of(name)), dtype=TORCH_DTYPE[dtype]).reshape(shape).clone()


def make_folder(folder: Path, layout: str) -> Path:
    """A folder as Hugging Face writes one, each file built here (safetensors from the spec)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    total = sum(len(raw_of(n)) for n in WEIGHTS)
    if layout == "safetensors":
        ref.write_safetensors(folder / "model.safetensors", {n: (d, s, raw_of(n)) for n, (d, s, _) in WEIGHTS.items()},
                              metadata={"format": "pt"})
    elif layout == "safetensors-sharded":
        weight_map = {}
        for i, names in enumerate(SHARDS):
            file = f"model-{i + 1:05d}-of-{len(SHARDS):05d}.safetensors"
            ref.write_safetensors(folder / file, {n: (WEIGHTS[n][0], WEIGHTS[n][1], raw_of(n)) for n in names})
            weight_map.update(dict.fromkeys(names, file))
        ref.write_index(folder / "model.safetensors.index.json", weight_map, total)
    elif layout in ("bin", "bin-legacy"):
        torch.save({n: torch_tensor(n) for n in WEIGHTS}, folder / "pytorch_model.bin",
                   _use_new_zipfile_serialization=layout == "bin")
    elif layout == "bin-sharded":
        weight_map = {}
        for i, names in enumerate(SHARDS):
            file = f"pytorch_model-{i + 1:05d}-of-{len(SHARDS):05d}.bin"
            torch.save({n: torch_tensor(n) for n in names}, folder / file)
            weight_map.update(dict.fromkeys(names, file))
        ref.write_index(folder / "pytorch_model.bin.index.json", weight_map, total)
    else:
        raise ValueError(layout)
    return folder


@pytest.mark.parametrize("layout", ["safetensors", "safetensors-sharded", "bin", "bin-legacy", "bin-sharded"])
def test_every_layout_reads_lazily_and_exactly(tmp_path, layout):
    folder = HFFolder.open(make_folder(tmp_path / "m", layout))
    assert folder.config == CONFIG
    assert sorted(folder.names()) == sorted(WEIGHTS)
    for name, (dtype, shape, _) in WEIGHTS.items():
        assert name in folder
        assert folder.shape(name) == tuple(shape) and folder.dtype(name) == TORCH_DTYPE[dtype]
        t = folder.read(name)
        assert t.dtype == TORCH_DTYPE[dtype] and list(t.shape) == shape
        assert raw_bytes(t) == raw_of(name), name
        if layout.endswith("sharded"):
            shard = next(i for i, names in enumerate(SHARDS) if name in names) + 1
            assert folder.file_of(name).name.split("-")[1] == f"{shard:05d}"


def test_safetensors_are_preferred_in_hugging_face_order(tmp_path):
    folder = make_folder(tmp_path / "m", "bin")
    torch.save({"other": torch.zeros(1)}, folder / "ignored.bin")
    make_folder(folder, "safetensors-sharded")
    assert HFFolder.open(folder).weights.name == "model.safetensors.index.json"
    make_folder(folder, "safetensors")
    assert HFFolder.open(folder).weights.name == "model.safetensors"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("limit", [10_000, 40])
def test_write_and_read_back(tmp_path, limit):
    tensors = {name: torch_tensor(name) for name in WEIGHTS}
    tensors["lm_head.weight"] = tensors["lm_head.weight"].t().contiguous().t()  # layout must not matter
    written = write_hf_folder(tmp_path / "out", tensors, CONFIG, max_shard_bytes=limit)
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text()) == CONFIG
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~_umask()
    assert os.stat(out / written.files[0]).st_mode & 0o777 == 0o666 & ~_umask()
    total = sum(len(raw_of(n)) for n in WEIGHTS)
    if limit > total:
        assert written.files == ("model.safetensors",)
        assert ref.parse_safetensors(out / "model.safetensors")[1] == {"format": "pt"}
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index == {"metadata": {"total_size": total}, "weight_map": written.weight_map}
        for file in set(index["weight_map"].values()):
            held = ref.parse_safetensors(out / file)[2]
            assert sum(len(raw) for _, _, raw in held.values()) <= limit or len(held) == 1
            assert {n: raw for n, (_, _, raw) in held.items()} == {n: raw_of(n) for n in held}
    back = HFFolder.open(out)
    assert back.config == CONFIG and sorted(back.names()) == sorted(WEIGHTS)
    for name in WEIGHTS:
        assert raw_bytes(back.read(name)) == raw_of(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_rewriting_a_folder_keeps_other_files_and_drops_stale_weights(tmp_path):
    folder = make_folder(tmp_path / "m", "safetensors-sharded")
    (folder / "tokenizer.json").write_text("{}")
    tensors = {name: torch_tensor(name) for name in WEIGHTS}
    write_hf_folder(folder, tensors, {"model_type": "gpt2"})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    write_hf_folder(folder, tensors, {"model_type": "gpt2"}, max_shard_bytes=40)
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and "tokenizer.json" in names
    assert HFFolder.open(folder).config == {"model_type": "gpt2"}


def test_carried_files_are_written_with_the_weights_into_a_new_or_an_existing_folder(tmp_path):
    tensors = {name: torch_tensor(name) for name in WEIGHTS}
    carried = {"generation_config.json": b'{"eos_token_id": [2, 7]}\n'}
    for folder in (tmp_path / "new", make_folder(tmp_path / "old", "safetensors")):
        write_hf_folder(folder, tensors, CONFIG, files=carried)
        assert (folder / "generation_config.json").read_bytes() == carried["generation_config.json"]
        assert HFFolder.open(folder).config == CONFIG
    for name in ("config.json", "model.safetensors", "../escape.json"):
        with pytest.raises(TensorFileError, match="not a file an export carries"):
            write_hf_folder(tmp_path / "bad", tensors, CONFIG, files={name: b"{}"})
    assert not (tmp_path / "bad").exists() and not (tmp_path / "escape.json").exists()


def test_a_failed_write_leaves_no_folder(tmp_path):
    with pytest.raises(NotImplementedError):  # a meta tensor has no bytes to copy out
        write_hf_folder(tmp_path / "out", {"a": torch.ones(2), "b": torch.empty(2, device="meta")}, CONFIG)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TensorFileError, match=r"out/config\.json: the config cannot be written as JSON"):
        write_hf_folder(tmp_path / "out", {"a": torch.ones(2)}, {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def _edit_index(folder: Path, edit) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def _duplicate_in_index(folder: Path) -> None:
    path = folder / "model.safetensors.index.json"
    text = path.read_text().replace('"weight_map": {', '"weight_map": {\n"step": "model-00001-of-00003.safetensors",')
    path.write_text(text)


def _in_two_shards(folder: Path) -> None:
    first = "model-00001-of-00003.safetensors"
    names = SHARDS[0] + ["step"]
    ref.write_safetensors(folder / first, {n: (WEIGHTS[n][0], WEIGHTS[n][1], raw_of(n)) for n in names})


def _truncate(path: Path, cut: int = 2) -> None:
    path.write_bytes(path.read_bytes()[:-cut])


BROKEN = {  # case -> (layout, break it, words the message must hold)
    "no such folder": (None, lambda f: None, ["no such directory"]),
    "empty folder": ("empty", lambda f: None, ["not a Hugging Face model folder", "model.safetensors,",
                                               "model.safetensors.index.json", "pytorch_model.bin,",
                                               "pytorch_model.bin.index.json", "config.json"]),
    "no config": ("safetensors", lambda f: (f / "config.json").unlink(), ["config.json: missing"]),
    "bad config": ("safetensors", lambda f: (f / "config.json").write_text("{"), ["config.json: not valid JSON"]),
    "config not an object": ("safetensors", lambda f: (f / "config.json").write_text("[]"), ["config.json", "list"]),
    "missing shard": ("safetensors-sharded", lambda f: (f / "model-00002-of-00003.safetensors").unlink(),
                      ["index.json", "'model.layers.0.input_layernorm.weight'", "model-00002-of-00003", "missing"]),
    "listed twice in the index": ("safetensors-sharded", _duplicate_in_index, ["index.json", "'step'", "listed twice"]),
    "in two shards": ("safetensors-sharded", _in_two_shards,
                      ["'step'", "listed twice", "model-00001-of-00003", "model-00003-of-00003"]),
    "not in the index": ("safetensors-sharded", lambda f: _edit_index(f, lambda m: m.pop("step")),
                         ["model-00003-of-00003.safetensors", "'step'", "does not list"]),
    "index points elsewhere": ("safetensors-sharded",
                               lambda f: _edit_index(f, lambda m: m.update({"step": "model-00001-of-00003.safetensors"})),
                               ["index.json", "'step'", "model-00001-of-00003", "does not hold it"]),
    "escaping index": ("safetensors-sharded", lambda f: _edit_index(f, lambda m: m.update({"step": "../x.safetensors"})),
                       ["'step'", "../x.safetensors", "not a file name"]),
    "truncated shard": ("safetensors-sharded", lambda f: _truncate(f / "model-00003-of-00003.safetensors"),
                        ["model-00003-of-00003.safetensors", "truncated", "'step'"]),
    "unknown dtype": ("safetensors", lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes().replace(b'"F16"', b'"X16"')),
        ["model.safetensors", "'model.norm.weight'", "'X16'"]),
    "truncated bin": ("bin", lambda f: _truncate(f / "pytorch_model.bin", 100), ["pytorch_model.bin", "truncated or corrupt"]),
    "bin of non-tensors": ("bin", lambda f: torch.save({"n_layers": 3}, f / "pytorch_model.bin"),
                           ["pytorch_model.bin", "'n_layers'", "not a tensor"]),
    "bin shard missing": ("bin-sharded", lambda f: (f / "pytorch_model-00003-of-00003.bin").unlink(),
                          ["pytorch_model.bin.index.json", "'lm_head.weight'", "pytorch_model-00003-of-00003.bin", "missing"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_folders_are_one_clear_error(tmp_path, case):
    layout, breaks, words = BROKEN[case]
    folder = tmp_path / "m"
    if layout == "empty":
        folder.mkdir()
    elif layout is not None:
        make_folder(folder, layout)
    breaks(folder)
    with pytest.raises(TensorFileError) as caught:
        HFFolder.open(folder)
    message = str(caught.value)
    assert isinstance(caught.value, CheckpointError) and "\n" not in message and str(folder) in message
    for word in words:
        assert word in message, (case, message)


def test_reading_an_unknown_tensor_names_it(tmp_path):
    folder = HFFolder.open(make_folder(tmp_path / "m", "safetensors"))
    with pytest.raises(TensorFileError, match=r"model\.safetensors: no tensor 'transformer\.wte\.weight'"):
        folder.read("transformer.wte.weight")
