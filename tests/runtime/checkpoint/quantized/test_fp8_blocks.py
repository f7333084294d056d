"""Block FP8 against an elementwise reference written from the definitions (e4m3 bit layout, OCP 8-bit FP spec;
w = code * scale_inv[r // b0, c // b1], DeepSeek-V3's weight_dequant; scale = amax / 448), and against the
released-layout fixture deepseek-v3-fp8, made from deepseek-v3's weights by the fixture generator."""

from __future__ import annotations

import pytest
import torch

from runtime.checkpoint.quantized import fp8_blocks
from runtime.checkpoint.safetensors import load_file
from tests.paths import FIXTURE_ROOT
from tests.runtime.checkpoint.quantized.reference import fp8_reference_dequantize, fp8_reference_quantize
from tests.runtime.checkpoint.quantized.spy import Spy, row_slice

FIXTURES = FIXTURE_ROOT / "hf-models"


def random_codes(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # no NaNs
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape, block", [((37, 45), (16, 16)), ((24, 48), (16, 16)), ((9, 70), (4, 32))])
def test_dequantize_matches_the_elementwise_definition_with_partial_blocks(shape, block):
    codes = random_codes(shape, seed=1)
    grid = fp8_blocks.grid_shape(shape, block)
    scales = torch.rand(grid, generator=torch.Generator().manual_seed(2)) * 1e-2 + 1e-4
    got = fp8_blocks.dequantize(codes, scales, block)
    expected = fp8_reference_dequantize(codes.view(torch.uint8).tolist(), scales.tolist(), block)
    assert got.dtype == torch.float32 and got.tolist() == expected


@pytest.mark.parametrize("shape, block", [((37, 45), (16, 16)), ((9, 70), (4, 32))])
def test_quantize_matches_the_elementwise_definition(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.3
    w[0, :5] = torch.tensor([1e-9, -1e-9, 0.0, -0.0, 1e-3])  # subnormal codes, signed zeros
    codes, scales = fp8_blocks.quantize(w, block)
    ref_codes, ref_scales = fp8_reference_quantize(w.tolist(), block)
    assert scales.dtype == torch.float32 and scales.tolist() == ref_scales
    assert codes.dtype == torch.float8_e4m3fn and codes.view(torch.uint8).tolist() == ref_codes


def test_round_trip_is_within_half_an_e4m3_step_of_each_value():
    w = torch.randn(40, 50, generator=torch.Generator().manual_seed(4)) * torch.logspace(-4, 1, 50)
    codes, scales = fp8_blocks.quantize(w, (16, 16))
    back = fp8_blocks.dequantize(codes, scales, (16, 16))
    scale = scales.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :50]
    # e4m3 has 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 (half of 2^-9) below 2^-6.
    bound = scale * torch.maximum((w / scale).abs() * 2.0 ** -4, torch.tensor(2.0 ** -10)) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (back.abs().amax() - w.abs().amax()).abs() <= 1e-6 * w.abs().amax()  # each block's amax is exact (448)


def test_dequantize_then_quantize_gives_the_same_bytes():
    w = torch.randn(64, 80, generator=torch.Generator().manual_seed(5)) * torch.logspace(-6, 3, 80)
    codes, scales = fp8_blocks.quantize(w, (16, 32))
    again, again_scales = fp8_blocks.quantize(fp8_blocks.dequantize(codes, scales, (16, 32)), (16, 32))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(again_scales, scales)


def test_every_scale_is_recovered_from_its_dequantized_block_maximum():
    # Why the bytes come back: a block's largest code is +-448, so its dequantized amax is fl(448 * s) with
    # s = fl(amax / 448); and fl(fl(448 * s) / 448) == s for every float32 amax (all mantissas of one binade;
    # the others differ by a power of two).
    amax = ((torch.arange(2 ** 23, dtype=torch.int32) | (127 << 23))).view(torch.float32)
    s = amax / 448
    assert torch.equal((s * 448) / 448, s)


def test_an_all_zero_block_gets_scale_one_and_zero_codes():
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(6))
    w[16:, :16] = 0
    codes, scales = fp8_blocks.quantize(w, (16, 16))
    assert scales[1, 0].item() == 1.0 and not torch.isnan(scales).any()
    assert (codes[16:, :16].view(torch.uint8) == 0).all()
    back = fp8_blocks.dequantize(codes, scales, (16, 16))
    assert (back[16:, :16] == 0).all()
    assert torch.equal(fp8_blocks.quantize(back, (16, 16))[1], scales)


def test_values_beyond_448_scales_saturate_instead_of_becoming_nan():
    w = torch.tensor([[500.0, -470.0, 448.0, 1e6]])
    codes = fp8_blocks.encode(w, torch.ones(1, 1), (1, 4))
    assert codes.view(torch.uint8).tolist() == [[0x7E, 0xFE, 0x7E, 0x7E]]  # +-448, the largest finite
    assert fp8_blocks.dequantize(codes, torch.ones(1, 1), (1, 4)).tolist() == [[448.0, -448.0, 448.0, 448.0]]


@pytest.mark.parametrize("start, stop", [(0, 37), (5, 21), (16, 32), (17, 18), (36, 37), (9, 9)])
def test_dequantize_rows_slices_only_those_rows_and_their_scale_rows(start, stop):
    codes = random_codes((37, 45), seed=7)
    scales = torch.rand(3, 3, generator=torch.Generator().manual_seed(8)) + 0.5
    expected = fp8_blocks.dequantize(codes, scales, (16, 16))[start:stop]
    spy_codes, spy_scales = Spy.wrap(codes), Spy.wrap(scales)
    got = fp8_blocks.dequantize_rows(spy_codes, spy_scales, (16, 16), start, stop)
    assert torch.equal(got, expected)
    assert spy_codes.reads() == row_slice(start, stop)
    assert spy_scales.reads() == row_slice(start // 16, -(-stop // 16))


def test_bad_shapes_and_values_are_refused():
    codes = random_codes((24, 48), seed=9)
    with pytest.raises(ValueError, match=r"scale_inv has shape \[2, 2\].*needs \[2, 3\]"):
        fp8_blocks.dequantize(codes, torch.ones(2, 2), (16, 16))
    with pytest.raises(ValueError, match="rows"):
        fp8_blocks.dequantize_rows(codes, torch.ones(2, 3), (16, 16), 20, 25)
    with pytest.raises(ValueError, match="non-finite"):
        fp8_blocks.quantize(torch.tensor([[1.0, float("inf")]]), (1, 2))
    with pytest.raises(ValueError, match="block size"):
        fp8_blocks.quantize(torch.ones(2, 2), (0, 2))


def test_the_released_fixture_is_deepseek_v3_quantized_by_this_recipe():
    original = load_file(FIXTURES / "deepseek-v3" / "model.safetensors")
    stored = load_file(FIXTURES / "deepseek-v3-fp8" / "model.safetensors")
    weights = [name.removesuffix("_scale_inv") for name in stored if name.endswith("_scale_inv")]
    assert len(weights) == 60
    worst = 0.0
    for name in weights:
        codes, scales = fp8_blocks.quantize(original[name], (16, 16))
        assert torch.equal(codes.view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(scales, stored[name + "_scale_inv"]), name
        back = fp8_blocks.dequantize(stored[name], stored[name + "_scale_inv"], (16, 16))
        worst = max(worst, (back - original[name]).abs().max().item())
    assert 0.02 < worst <= 0.0273  # the fixture README: the weights move by up to 0.0272
