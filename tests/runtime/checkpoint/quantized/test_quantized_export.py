"""Writing the released layouts: a released-layout fixture read (dequantized) and quantized again gives its bytes
bit for bit, and a random state dict written then read gives the codecs' values back."""

from __future__ import annotations

import pytest
import torch

from runtime.checkpoint.hf_folder import HFFolder, write_hf_folder
from runtime.checkpoint.quantized import fp8_blocks, mxfp4
from runtime.checkpoint.quantized.export import name_patterns, quantize_for_export
from runtime.checkpoint.quantized.folder import open_folder
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "hf-models"
# The released checkpoints' choices (export.py's docstring), as a family would give them.
DEEPSEEK_V3_FP8 = ["model.layers.*_proj.weight", "model.layers.*_proj_with_mqa.weight"]
GPT_OSS_MXFP4 = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fixture, kwargs", [
    ("deepseek-v3-fp8", {"method": "fp8-blocks", "which": DEEPSEEK_V3_FP8, "block_size": (16, 16)}),
    ("gpt-oss-mxfp4", {"method": "mxfp4", "which": GPT_OSS_MXFP4, "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}),
])
def test_a_released_folder_read_and_quantized_again_gives_its_bytes(fixture, kwargs):
    folder, stored = open_folder(FIXTURES / fixture), HFFolder.open(FIXTURES / fixture)
    logical = {name: folder.read(name) for name in folder.names()}
    export = quantize_for_export(logical, **kwargs)
    assert export.quantization_config == folder.config["quantization_config"]
    assert sorted(export.quantized) == sorted(folder.stored)
    assert sorted(export.tensors) == sorted(stored.names())
    for name, tensor in export.tensors.items():
        assert tensor.dtype == stored.dtype(name) and torch.equal(as_bytes(tensor), as_bytes(stored.read(name))), name


def random_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(50, 40, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(40, 40, generator=g) * 0.02,
            "model.layers.0.mlp.down_proj.weight": torch.randn(33, 70, generator=g),  # partial blocks both ways
            "model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 64, 10, generator=g),
            "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(3, 10, generator=g),
            "model.norm.weight": 1 + 0.2 * torch.randn(40, generator=g)}


@pytest.mark.parametrize("method, which, max_shard_bytes", [
    ("fp8-blocks", ["model.layers.*_proj.weight"], 10 ** 9),
    ("fp8-blocks", lambda name: name.endswith("down_proj.weight"), 2320),  # sharded: codes and scales apart
    ("mxfp4", ["*.experts.gate_up_proj"], 10 ** 9),
])
def test_a_written_folder_reads_back_as_the_codecs_values(tmp_path, method, which, max_shard_bytes):
    tensors = random_state_dict(seed=1)
    block = (16, 32) if method == "fp8-blocks" else None
    export = quantize_for_export(tensors, method=method, which=which, block_size=block)
    config = {"architectures": ["TinyForCausalLM"], "quantization_config": export.quantization_config}
    written = write_hf_folder(tmp_path / "out", export.tensors, config, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes < 10 ** 9:
        down = "model.layers.0.mlp.down_proj.weight"
        assert written.weight_map[down] != written.weight_map[down + "_scale_inv"]
    folder = open_folder(tmp_path / "out")
    assert sorted(folder.names()) == sorted(tensors)
    selected = name_patterns(which) if isinstance(which, list) else which
    for name, original in tensors.items():
        assert folder.shape(name) == tuple(original.shape), name
        if not selected(name):
            assert torch.equal(folder.read(name), original), name
        elif method == "fp8-blocks":
            expected = fp8_blocks.dequantize(*fp8_blocks.quantize(original, block), block)
            assert torch.equal(folder.read(name), expected) and torch.equal(folder.read_rows(name, 3, 20), expected[3:20])
            assert (expected - original).abs().max() <= original.abs().max() * 2.0 ** -4, name
        else:
            expected = mxfp4.unpack_experts(*mxfp4.pack_experts(original))
            assert torch.equal(folder.read(name), expected) and torch.equal(folder.read_rows(name, 1, 3), expected[1:3])
            assert (expected - original).abs().max() <= original.abs().max() / 6, name  # a step is at most amax / 6


def test_the_configs_are_the_released_ones():
    tensors = random_state_dict(seed=2)
    fp8 = quantize_for_export(tensors, method="fp8-blocks", which=["*q_proj.weight"])
    assert fp8.quantization_config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}
    assert fp8.tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    mx = quantize_for_export(tensors, method="mxfp4", which=["*gate_up_proj"], modules_to_not_convert=["lm_head"])
    assert mx.quantization_config == {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in mx.tensors
    assert mx.tensors["model.layers.0.mlp.experts.gate_up_proj_bias"] is tensors[
        "model.layers.0.mlp.experts.gate_up_proj_bias"]  # not selected: passed through


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "int4", "which": ["*"]}, r"method 'int4' is not a quantized layout \(choose from fp8-blocks, mxfp4\)"),
    ({"method": "fp8-blocks", "which": ["*.nothing"]}, "which selects none of the 6 tensors"),
    ({"method": "fp8-blocks", "which": ["model.norm.weight"]}, r"tensor 'model.norm.weight': block FP8 quantizes a "
                                                               r"floating-point matrix"),
    ({"method": "fp8-blocks", "which": ["*q_proj.weight"], "block_size": (0, 16)}, "block_size must be two positive"),
    ({"method": "mxfp4", "which": ["*down_proj.weight"]}, r"tensor 'model.layers.0.mlp.down_proj.weight': an expert "
                                                          r"parameter is \[experts, in, out\]"),
    ({"method": "mxfp4", "which": ["*gate_up_proj"], "block_size": (32, 32)}, "mxfp4's blocks are 32 elements"),
    ({"method": "mxfp4", "which": "*gate_up_proj"}, "which must be a predicate of names or a list of name patterns"),
])
def test_bad_arguments_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_for_export(random_state_dict(seed=3), **kwargs)


def test_a_part_name_that_is_already_a_tensor_is_refused():
    tensors = {"x.weight": torch.randn(4, 4), "x.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="its fp8-blocks part 'x.weight_scale_inv' is also a tensor"):
        quantize_for_export(tensors, method="fp8-blocks", which=["x.weight"])
