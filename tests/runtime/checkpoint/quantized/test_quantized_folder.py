"""Quantized Hugging Face folders read as their unquantized selves: tiny folders written here from the layouts'
published description (tests/hf_reference.py's independent safetensors writer; codes and scales as raw bytes,
expected values from the elementwise references), then the released-layout fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.checkpoint.hf_folder import HFFolder
from runtime.checkpoint.quantized import layouts
from runtime.checkpoint.quantized.folder import QuantizedFolder, open_folder
from runtime.checkpoint.safetensors import TensorFileError
from tests.hf_reference import pack, write_index, write_safetensors
from tests.paths import FIXTURE_ROOT
from tests.runtime.checkpoint.quantized.reference import f32, fp8_reference_dequantize, mx_reference_dequantize
from tests.runtime.checkpoint.quantized.spy import Spy, row_slice

FIXTURES = FIXTURE_ROOT / "hf-models"
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [4, 8]}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
Q = "model.layers.0.self_attn.q_a_proj.weight"  # [10, 20] in blocks of 4 x 8: scale grid [3, 3], both edges partial
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # [3 experts, 64 in, 5 out]


def random_bytes(n: int, seed: int, *, avoid: tuple[int, ...] = ()) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [b if b not in avoid else 0x30 for b in torch.randint(0, 256, (n,), generator=g).tolist()]


def fp8_tensors(seed: int = 0) -> tuple[dict, dict]:
    """(name -> (dtype, shape, bytes) as stored, name -> expected logical values as nested lists)."""
    codes = random_bytes(200, seed, avoid=(0x7F, 0xFF))  # no NaNs
    scales = [[f32(0.01 * (1 + i + 3 * j)) for j in range(3)] for i in range(3)]  # as the file holds them
    norm = [1.0 + 0.5 * i for i in range(20)]
    stored = {Q: ("F8_E4M3", [10, 20], bytes(codes)),
              Q + "_scale_inv": ("F32", [3, 3], pack("F32", sum(scales, []))),
              "model.norm.weight": ("F32", [20], pack("F32", norm))}
    rows = [codes[20 * r:20 * r + 20] for r in range(10)]
    return stored, {Q: fp8_reference_dequantize(rows, scales, (4, 8)), "model.norm.weight": norm}


def mxfp4_tensors(seed: int = 0) -> tuple[dict, dict]:
    blocks = random_bytes(3 * 5 * 2 * 16, seed)
    scales = [120 + b % 12 for b in random_bytes(3 * 5 * 2, seed + 1)]
    bias = [0.25 * i for i in range(15)]
    stored = {EXPERTS + "_blocks": ("U8", [3, 5, 2, 16], bytes(blocks)),
              EXPERTS + "_scales": ("U8", [3, 5, 2], bytes(scales)),
              EXPERTS + "_bias": ("F32", [3, 5], pack("F32", bias))}
    # [E, out, in] rows from the reference, transposed to the parameter's [E, in, out].
    rows = [[mx_reference_dequantize([blocks[16 * (2 * (5 * e + o) + k):][:16] for k in range(2)],
                                     scales[2 * (5 * e + o):][:2]) for o in range(5)] for e in range(3)]
    value = [[[rows[e][o][i] for o in range(5)] for i in range(64)] for e in range(3)]
    return stored, {EXPERTS: value, EXPERTS + "_bias": [bias[5 * e:5 * e + 5] for e in range(3)]}


def write_folder(folder: Path, stored: dict, qconfig: dict | None, *, shards: list[list[str]] | None = None) -> Path:
    folder.mkdir()
    config = {"architectures": ["TinyForCausalLM"], **({"quantization_config": qconfig} if qconfig else {})}
    (folder / "config.json").write_text(json.dumps(config))
    if shards is None:
        write_safetensors(folder / "model.safetensors", stored)
        return folder
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, {name: stored[name] for name in names})
        weight_map.update(dict.fromkeys(names, file))
    write_index(folder / "model.safetensors.index.json", weight_map, sum(len(v[2]) for v in stored.values()))
    return folder


def spy_reads(folder: QuantizedFolder) -> dict[str, Spy]:
    """Every tensor the wrapped folder hands out, by name, as a Spy that logs what is done with it."""
    handed: dict[str, Spy] = {}
    read = folder.folder.read

    def spying(name: str) -> torch.Tensor:
        handed[name] = Spy.wrap(read(name))
        return handed[name]
    folder.folder.read = spying
    return handed


@pytest.mark.parametrize("shards", [None, [[Q, "model.norm.weight"], [Q + "_scale_inv"]]])
def test_an_fp8_folder_shows_its_logical_tensors(tmp_path, shards):
    stored, expected = fp8_tensors()
    folder = open_folder(write_folder(tmp_path / "fp8", stored, FP8_CONFIG, shards=shards))  # scales in another shard
    assert isinstance(folder, QuantizedFolder)
    assert sorted(folder.names()) == [Q, "model.norm.weight"] and Q + "_scale_inv" not in folder
    assert folder.shape(Q) == (10, 20) and folder.dtype(Q) == torch.float32
    assert folder.file_of(Q).name == ("model.safetensors" if shards is None else "model-00001-of-00002.safetensors")
    assert folder.read(Q).tolist() == expected[Q]
    assert folder.read("model.norm.weight").tolist() == expected["model.norm.weight"]
    for start, stop in [(0, 10), (3, 9), (8, 10), (4, 4)]:
        assert folder.read_rows(Q, start, stop).tolist() == expected[Q][start:stop]


@pytest.mark.parametrize("start, stop", [(0, 10), (5, 7), (8, 10)])
def test_an_fp8_rows_read_slices_only_those_rows_and_their_scale_rows(tmp_path, start, stop):
    stored, expected = fp8_tensors(seed=1)
    folder = open_folder(write_folder(tmp_path / "fp8", stored, FP8_CONFIG))
    handed = spy_reads(folder)
    assert folder.read_rows(Q, start, stop).tolist() == expected[Q][start:stop]
    assert set(handed) == {Q, Q + "_scale_inv"}
    assert handed[Q].reads() == row_slice(start, stop)
    assert handed[Q + "_scale_inv"].reads() == row_slice(start // 4, -(-stop // 4))


def test_an_mxfp4_folder_shows_its_experts_input_major(tmp_path):
    stored, expected = mxfp4_tensors()
    folder = open_folder(write_folder(tmp_path / "mxfp4", stored, MXFP4_CONFIG, shards=[[EXPERTS + "_scales"],
                                      [EXPERTS + "_blocks", EXPERTS + "_bias"]]))
    assert sorted(folder.names()) == [EXPERTS, EXPERTS + "_bias"]
    assert folder.info(EXPERTS).shape == (3, 64, 5) and folder.dtype(EXPERTS) == torch.float32
    assert folder.read(EXPERTS).tolist() == expected[EXPERTS]
    assert folder.read(EXPERTS + "_bias").tolist() == expected[EXPERTS + "_bias"]


@pytest.mark.parametrize("start, stop", [(0, 3), (1, 2), (2, 3)])
def test_an_mxfp4_expert_range_read_slices_only_those_experts(tmp_path, start, stop):
    stored, expected = mxfp4_tensors(seed=2)
    folder = open_folder(write_folder(tmp_path / "mxfp4", stored, MXFP4_CONFIG))
    handed = spy_reads(folder)
    assert folder.read_rows(EXPERTS, start, stop).tolist() == expected[EXPERTS][start:stop]
    assert set(handed) == {EXPERTS + "_blocks", EXPERTS + "_scales"}
    assert all(spy.reads() == row_slice(start, stop) for spy in handed.values())


def test_opening_reads_headers_only(tmp_path, monkeypatch):
    stored, _ = fp8_tensors()
    path = write_folder(tmp_path / "fp8", stored, FP8_CONFIG)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read")
    monkeypatch.setattr(HFFolder, "read", refuse)
    folder = open_folder(path)
    assert [folder.info(name).shape for name in sorted(folder.names())] == [(10, 20), (20,)]


def test_a_plain_folder_opens_as_it_is_and_reads_rows_as_views(tmp_path):
    stored, expected = fp8_tensors()
    folder = open_folder(write_folder(tmp_path / "plain", {"model.norm.weight": stored["model.norm.weight"]}, None))
    assert type(folder) is HFFolder
    assert folder.read_rows("model.norm.weight", 2, 5).tolist() == expected["model.norm.weight"][2:5]
    with pytest.raises(TensorFileError, match=r"has no rows \[5, 30\)"):
        folder.read_rows("model.norm.weight", 5, 30)


def broken(stored: dict, name: str, entry: tuple | None) -> dict:
    out = {k: v for k, v in stored.items() if k != name}
    return out if entry is None else {**out, name: entry}


@pytest.mark.parametrize("make, qconfig, message", [
    (lambda s: s, {"quant_method": "gptq"}, r"config.json: quantization_config.quant_method 'gptq' is not a format "
                                            r"this engine reads \(it reads fp8, mxfp4\)"),
    (lambda s: s, {**FP8_CONFIG, "fmt": "e5m2"}, r"config.json: quantization_config.fmt 'e5m2'"),
    (lambda s: s, {**FP8_CONFIG, "weight_block_size": [4]}, r"config.json: quantization_config.weight_block_size"),
    (lambda s: broken(s, Q + "_scale_inv", None), FP8_CONFIG,
     rf"model.safetensors: tensor '{Q}' is float8_e4m3fn without its scales '{Q}_scale_inv'"),
    (lambda s: broken(s, Q + "_scale_inv", ("F32", [3, 2], pack("F32", [1.0] * 6))), FP8_CONFIG,
     rf"model.safetensors: tensor '{Q}_scale_inv' is float32 \[3, 2\]; '{Q}' \[10, 20\] in blocks of \[4, 8\] "
     rf"\(quantization_config.weight_block_size\) needs floating-point scales \[3, 3\]"),
    (lambda s: broken(s, Q, ("F32", [10, 20], pack("F32", [0.0] * 200))), FP8_CONFIG,
     rf"model.safetensors: tensor '{Q}' is float32 \[10, 20\]; beside '{Q}_scale_inv' it must be a float8_e4m3fn"),
    (lambda s: broken(s, Q, None), FP8_CONFIG, rf"tensor '{Q}_scale_inv' holds the scales of '{Q}', which the folder"),
])
def test_a_bad_fp8_folder_is_one_error_naming_file_and_tensor(tmp_path, make, qconfig, message):
    stored, _ = fp8_tensors()
    with pytest.raises(TensorFileError, match=message):
        open_folder(write_folder(tmp_path / "bad", make(stored), qconfig))


@pytest.mark.parametrize("make, message", [
    (lambda s: broken(s, EXPERTS + "_scales", None),
     rf"model.safetensors: tensor '{EXPERTS}_blocks' has no scales '{EXPERTS}_scales' beside it"),
    (lambda s: broken(s, EXPERTS + "_blocks", None), rf"tensor '{EXPERTS}_scales' has no blocks '{EXPERTS}_blocks'"),
    (lambda s: broken(s, EXPERTS + "_scales", ("U8", [3, 5, 3], bytes(45))),
     rf"tensor '{EXPERTS}_scales' is uint8 \[3, 5, 3\]; its blocks '{EXPERTS}_blocks' \[3, 5, 2, 16\] need uint8 "
     rf"\[3, 5, 2\]"),
    (lambda s: broken(s, EXPERTS + "_blocks", ("U8", [3, 5, 32], bytes(480))),
     rf"tensor '{EXPERTS}_blocks' is uint8 \[3, 5, 32\]; MXFP4 expert blocks are uint8 \[experts, out, in / 32, 16\]"),
])
def test_a_bad_mxfp4_folder_is_one_error_naming_file_and_tensor(tmp_path, make, message):
    stored, _ = mxfp4_tensors()
    with pytest.raises(TensorFileError, match=message):
        open_folder(write_folder(tmp_path / "bad", make(stored), MXFP4_CONFIG))


@pytest.mark.parametrize("plain, quantized, n_quantized, worst", [("deepseek-v3", "deepseek-v3-fp8", 60, 0.0273),
                                                                  ("gpt-oss", "gpt-oss-mxfp4", 8, 0.125)])
def test_the_released_fixtures_read_as_their_unquantized_folders(plain, quantized, n_quantized, worst):
    original, folder = HFFolder.open(FIXTURES / plain), open_folder(FIXTURES / quantized)
    assert isinstance(folder, QuantizedFolder) and len(folder.stored) == n_quantized
    assert sorted(folder.names()) == sorted(original.names())
    for name in original.names():
        assert folder.shape(name) == original.shape(name) and folder.dtype(name) == torch.float32, name
        difference = (folder.read(name) - original.read(name)).abs().max().item()
        assert difference <= worst if name in folder.stored else difference == 0, name
        rows = folder.read_rows(name, 1, 3)
        assert torch.equal(rows, folder.read(name)[1:3]), name


def test_the_layouts_are_registered_by_quant_method():
    assert set(layouts.READERS) == {"fp8", "mxfp4"}
    assert layouts.layout_of({"quant_method": "fp8", "weight_block_size": [16, 16]}, Path("c.json")).block == (16, 16)
    assert layouts.layout_of({"quant_method": "fp8"}, Path("c.json")).block == (128, 128)  # transformers' default
