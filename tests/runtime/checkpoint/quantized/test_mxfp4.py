"""MXFP4 against an elementwise reference written from the OCP MX v1.0 definitions (E2M1 bits, E8M0 scales,
element 2j in byte j's low nibble as gpt-oss packs them) and against the released-layout fixture gpt-oss-mxfp4,
made from gpt-oss's experts by the fixture generator (exponent ceil(log2(amax / 6)), nearest code, ties down)."""

from __future__ import annotations

import pytest
import torch

from runtime.checkpoint.quantized import mxfp4
from runtime.checkpoint.safetensors import load_file
from tests.paths import FIXTURE_ROOT
from tests.runtime.checkpoint.quantized.reference import (
    MAGNITUDES,
    e2m1_value,
    e8m0_value,
    mx_reference_dequantize,
    mx_reference_quantize,
)
from tests.runtime.checkpoint.quantized.spy import Spy, row_slice

FIXTURES = FIXTURE_ROOT / "hf-models"


def test_the_code_values_follow_the_e2m1_bits():
    assert MAGNITUDES == list(mxfp4.E2M1_VALUES)


def test_dequantize_matches_the_elementwise_definition():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 160, (2, 3, 4), generator=g, dtype=torch.uint8)
    scales[0, 0, :3] = torch.tensor([0, 254, 127])  # the extremes: 2^-127 (subnormal in float32) and 2^127
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == (2, 3, 128) and got.dtype == torch.float32
    for i in range(2):
        for j in range(3):
            expected = mx_reference_dequantize(blocks[i, j].tolist(), scales[i, j].tolist())
            assert [float(v) for v in got[i, j].tolist()] == [float(torch.tensor(v)) for v in expected]


def test_a_nan_scale_makes_its_whole_block_nan():
    blocks = torch.full((2, 16), 0x21, dtype=torch.uint8)
    got = mxfp4.dequantize(blocks, torch.tensor([255, 127], dtype=torch.uint8))
    assert torch.isnan(got[:32]).all() and got[32:].tolist() == [0.5, 1.0] * 16


def test_quantize_matches_the_elementwise_definition():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 128, generator=g) * torch.logspace(-3, 2, 4).repeat_interleave(32)
    x[0, :32] = 0  # an all-zero block
    x[1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -1e-3] + [0.5] * 20)
    x[2, 32:64] *= 1e-40  # tiny: the exponent clamps at -127
    blocks, scales = mxfp4.quantize(x)
    for row in range(3):
        ref_blocks, ref_scales = mx_reference_quantize(x[row].tolist())
        assert blocks[row].tolist() == ref_blocks and scales[row].tolist() == ref_scales
    assert scales[0, 0] == 0 and (blocks[0, 0] == 0).all()  # zeros: the smallest scale, code +0
    assert mxfp4.dequantize(blocks[1:2, :1], scales[1:2, :1])[0, :11].tolist() == [
        6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.5, -4.0]  # ties to the smaller magnitude, and +0


def test_round_trip_is_within_half_a_step_of_each_value():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-5, 5, 8)[:, None]
    blocks, scales = mxfp4.quantize(x)
    back = mxfp4.dequantize(blocks, scales)
    scale = (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=-1)
    v = (x.double() / scale).abs()
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))  # gaps 0.5, 1, 2 between magnitudes
    assert ((back.double() - x.double()).abs() <= half_step * scale).all()
    assert (v <= 6).all()  # the exponent leaves nothing to saturate


def generator_shaped_blocks(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored blocks as the generator writes them: a largest code of 3, 4 or 6 (amax / 2^e in (3, 6]), no -0,
    and a 0.5 or 1.5 in each block (else a block of largest code 6 is also exactly codes / 2 one exponent up)."""
    g = torch.Generator().manual_seed(seed)
    top = torch.randint(5, 8, (6, 4, 1), generator=g)
    codes = torch.minimum(torch.randint(0, 8, (6, 4, 32), generator=g), top)
    codes[..., 0], codes[..., 1] = top[..., 0], torch.where(torch.rand(6, 4, generator=g) < 0.5, 1, 3)
    sign = (torch.rand(6, 4, 32, generator=g) < 0.5) & (codes > 0)
    codes = codes | (sign.long() << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, torch.randint(110, 140, (6, 4), generator=g, dtype=torch.uint8)


def test_dequantize_then_quantize_gives_the_same_bytes():
    blocks, scales = generator_shaped_blocks(seed=4)
    again_blocks, again_scales = mxfp4.quantize(mxfp4.dequantize(blocks, scales))
    assert torch.equal(again_scales, scales) and torch.equal(again_blocks, blocks)


def test_a_block_exact_at_two_exponents_is_stored_at_the_larger():
    # [3, 2, 1, 0...] * 2^0 is also [6, 4, 2, 0...] * 2^-1: ceil(log2(3 / 6)) = -1 picks the latter, the released
    # files hold the former (a largest code of 3), and both are the same values.
    x = torch.tensor([3.0, 2.0, -1.0] + [0.0] * 29)
    blocks, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127] and blocks[0, :2].tolist() == [0x45, 0x0A]  # codes 5, 4 | -1 (0b1010), 0
    assert torch.equal(mxfp4.dequantize(blocks, scales), x)
    y = x.clone()
    y[3] = 0.25  # now only exact at 2^-1 (0.25 = 0.5 * 2^-1): the formula's exponent
    assert mxfp4.quantize(y)[1].tolist() == [126]


def test_values_beyond_six_scales_saturate():
    x = torch.tensor([7.0, -100.0, 5.0, 6.5] + [0.0] * 28)
    codes = mxfp4.encode(x, torch.tensor([127], dtype=torch.uint8))
    assert codes[0, :2].tolist() == [0xF7, 0x76]  # 6 and -6 (codes 7, 15); 5 ties down to 4 (6), 6.5 to 6 (7)
    huge = torch.tensor([1e40] + [1.0] * 31, dtype=torch.float64)  # beyond 6 * 2^127: E8M0's largest scale
    blocks, scales = mxfp4.quantize(huge)
    assert scales.tolist() == [254] and blocks[0, 0].item() & 15 == 7


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.ones(2, 40))
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4.quantize(torch.full((32,), float("nan")))
    with pytest.raises(ValueError, match="scales must be uint8"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.encode(torch.ones(32), torch.tensor([255], dtype=torch.uint8))


def test_the_expert_layout_transposes_each_expert_and_blocks_its_inputs():
    param = torch.randn(2, 64, 3, generator=torch.Generator().manual_seed(5))  # [E, in, out]
    blocks, scales = mxfp4.pack_experts(param)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    back = mxfp4.unpack_experts(blocks, scales)
    for e in range(2):
        for i in range(64):
            for o in range(3):
                byte = blocks[e, o, i // 32, (i % 32) // 2].item()
                code = byte >> 4 if i % 2 else byte & 15
                assert back[e, i, o].item() == e2m1_value(code) * e8m0_value(scales[e, o, i // 32].item())
    assert back.is_contiguous() and torch.equal(back, mxfp4.dequantize(blocks, scales).transpose(1, 2))


@pytest.mark.parametrize("start, stop", [(0, 4), (1, 3), (3, 4), (2, 2)])
def test_unpack_experts_slices_only_those_experts(start, stop):
    param = torch.randn(4, 64, 5, generator=torch.Generator().manual_seed(6))
    blocks, scales = mxfp4.pack_experts(param)
    spy_blocks, spy_scales = Spy.wrap(blocks), Spy.wrap(scales)
    got = mxfp4.unpack_experts(spy_blocks, spy_scales, start, stop)
    assert torch.equal(got, mxfp4.unpack_experts(blocks, scales)[start:stop])
    assert spy_blocks.reads() == row_slice(start, stop) and spy_scales.reads() == row_slice(start, stop)


def test_the_released_fixture_is_gpt_oss_quantized_by_this_recipe():
    original = load_file(FIXTURES / "gpt-oss" / "model.safetensors")
    stored = load_file(FIXTURES / "gpt-oss-mxfp4" / "model.safetensors")
    experts = [name.removesuffix("_blocks") for name in stored if name.endswith("_blocks")]
    assert len(experts) == 8
    worst = 0.0
    for name in experts:
        blocks, scales = mxfp4.pack_experts(original[name])
        assert torch.equal(blocks, stored[name + "_blocks"]) and torch.equal(scales, stored[name + "_scales"]), name
        back = mxfp4.unpack_experts(stored[name + "_blocks"], stored[name + "_scales"])
        assert back.shape == original[name].shape
        worst = max(worst, (back - original[name]).abs().max().item())
        again = mxfp4.pack_experts(back)  # the read values quantize to the stored bytes again
        assert torch.equal(again[0], stored[name + "_blocks"]) and torch.equal(again[1], stored[name + "_scales"])
    assert 0.1 < worst <= 0.125  # the fixture README: the weights move by up to 0.125


def test_quantizing_in_chunks_of_dim_0_gives_the_same_bytes(monkeypatch):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(7))
    whole = mxfp4.quantize(x)
    monkeypatch.setattr(mxfp4, "_CHUNK_ELEMENTS", 2 * 3 * 64)  # chunks of 2, 2 and 1 rows of dim 0
    chunked = mxfp4.quantize(x)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    assert chunked[0].shape == (5, 3, 2, 16) and torch.equal(chunked[1][4], mxfp4.quantize(x[4])[1])
