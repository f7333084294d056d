"""--init-from a quantized folder: a family that knows nothing of quantization (Qwen3-MoE here) reads an FP8
block-quantized copy of its fixture exactly as it reads the unquantized folder of the dequantized values; the
headers-only check dequantizes nothing; rows reads (stacked experts, and a parameter its family marks
``row_wise``) read only their rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from models import parameter_shapes
from runtime.checkpoint.hf_folder import HFFolder, write_hf_folder
from runtime.checkpoint.hf_weights import check_weights, initial_values, read_hf_model, read_state_dict
from runtime.checkpoint.quantized import fp8_blocks
from runtime.checkpoint.quantized.export import name_patterns, quantize_for_export
from runtime.checkpoint.quantized.layouts import Fp8Blocks
from tests.paths import FIXTURE_ROOT
from tests.runtime.checkpoint.quantized.spy import Spy, row_slice

FIXTURE = FIXTURE_ROOT / "hf-models" / "qwen3-moe"
LINEAR = ["model.layers.*_proj.weight"]  # attention, the dense MLP and every expert: 51 matrices
BLOCK = (16, 16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(the fixture quantized to block FP8, a plain folder of what that quantization reads back as)."""
    root = tmp_path_factory.mktemp("qwen3-moe")
    source = HFFolder.open(FIXTURE)
    tensors = {name: source.read(name) for name in source.names()}
    export = quantize_for_export(tensors, method="fp8-blocks", which=LINEAR, block_size=BLOCK)
    assert len(export.quantized) == 51
    write_hf_folder(root / "fp8", export.tensors, {**source.config, "quantization_config": export.quantization_config})
    selected = name_patterns(LINEAR)
    values = {name: fp8_blocks.dequantize(*fp8_blocks.quantize(t, BLOCK), BLOCK) if selected(name) else t
              for name, t in tensors.items()}
    write_hf_folder(root / "plain", values, source.config)
    return root / "fp8", root / "plain"


def test_the_headers_check_sees_the_logical_tensors_and_dequantizes_nothing(folders, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("check_weights dequantized a tensor")
    monkeypatch.setattr(Fp8Blocks, "read", refuse)
    weights = check_weights(read_hf_model(folders[0]))
    plain = check_weights(read_hf_model(folders[1]))
    assert weights.names == plain.names and weights.unused == ()


def test_the_model_reads_the_same_values_as_from_the_unquantized_folder(folders):
    quantized, plain = (check_weights(read_hf_model(folder)) for folder in folders)
    cfg = quantized.model.config
    got, expected = read_state_dict(quantized, cfg), read_state_dict(plain, cfg)
    assert got.keys() == expected.keys()
    for name in got:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], expected[name]), name
    original = read_state_dict(check_weights(read_hf_model(FIXTURE)), cfg)
    assert 0 < (got["layers.0.attn.q.weight"] - original["layers.0.attn.q.weight"]).abs().max() < 0.05


def spy_reads(weights) -> dict[str, Spy]:
    handed: dict[str, Spy] = {}
    inner = weights.folder.folder  # the QuantizedFolder's HFFolder
    read = inner.read

    def spying(name: str) -> torch.Tensor:
        handed[name] = Spy.wrap(read(name))
        return handed[name]
    inner.read = spying
    return handed


def test_a_ranks_experts_are_read_alone(folders):
    weights = check_weights(read_hf_model(folders[0]))
    shapes = parameter_shapes(weights.model.config)
    full = initial_values(weights)("layers.0.moe.experts.w2", shapes["layers.0.moe.experts.w2"])
    handed = spy_reads(weights)
    part = initial_values(weights).rows("layers.0.moe.experts.w2", shapes["layers.0.moe.experts.w2"], 2, 4)
    assert torch.equal(part, full[2:4])
    assert sorted(handed) == sorted(f"model.layers.0.mlp.experts.{e}.down_proj.weight{suffix}"
                                    for e in (2, 3) for suffix in ("", "_scale_inv"))


def test_a_row_wise_parameter_dequantizes_only_its_rows(folders):
    weights = check_weights(read_hf_model(folders[0]))
    name, shape = "layers.1.attn.o.weight", parameter_shapes(weights.model.config)["layers.1.attn.o.weight"]
    full = initial_values(weights)(name, shape)
    spec = weights.model.spec
    row_wise = dataclasses.replace(spec, hf=dataclasses.replace(spec.hf, row_wise=lambda n: n == name))
    weights = dataclasses.replace(weights, model=dataclasses.replace(weights.model, spec=row_wise))
    handed = spy_reads(weights)
    part = initial_values(weights).rows(name, shape, 20, 37)
    assert torch.equal(part, full[20:37])
    hf_name = "model.layers.1.self_attn.o_proj.weight"
    assert handed[hf_name].reads() == row_slice(20, 37) and handed[hf_name + "_scale_inv"].reads() == row_slice(1, 3)
