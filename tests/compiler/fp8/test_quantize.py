"""compiler/fp8/quantize.py and each recipe's quantize / dequantize against the element-by-element definitions
(reference.py): scales, rounding to nearest even in e4m3 / e5m2, partial edge blocks, saturation, zeros and
rowwise's power-of-two scales; and what torch's own FP8 cast does."""

from __future__ import annotations

import math

import pytest
import torch

from compiler.fp8 import RECIPES
from compiler.fp8.quantize import quantize_blocks, saturating_cast
from compiler.fp8.tensor import E4M3, E5M2, INPUT_FORWARD, ROLES, WEIGHT_FORWARD
from tests.compiler.fp8.reference import FORMATS, quantize_reference, round_fp8


def varied(rows: int, cols: int, *, seed: int) -> torch.Tensor:
    """Values over many binades (some in the formats' subnormal range after scaling), rows and columns of
    different magnitudes, an exact zero and exact powers of two."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 4, (rows, cols), generator=g).float())
    t = t * torch.exp2(torch.randint(-3, 3, (rows, 1), generator=g).float())
    t[0, 0], t[-1, -1] = 0.0, 2.0 ** -5
    return t


def assert_matches_reference(t: torch.Tensor, recipe, role) -> None:
    q = recipe.quantize(t, role)
    block = recipe.block(role, tuple(t.shape))
    values, scales = quantize_reference(t, block, recipe.dtypes[role.kind], power_of_two=recipe.power_of_two)
    assert q.data.dtype == recipe.dtypes[role.kind] and q.scale.dtype == torch.float32
    assert torch.equal(q.scale, torch.tensor(scales)), f"{recipe.name} {role}: scales"
    assert torch.equal(q.data.float(), torch.tensor(values)), f"{recipe.name} {role}: FP8 values"
    expected = torch.tensor(values) * q.element_scale()
    assert torch.equal(recipe.dequantize(q), expected)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_tensorwise_and_rowwise_quantize_as_defined(name):
    recipe = RECIPES[name]
    t = varied(9, 13, seed=1)
    for role in ROLES:
        assert_matches_reference(t, recipe, role)


def test_blockwise_quantizes_tiles_and_blocks_with_partial_edges_as_defined():
    recipe = RECIPES["blockwise"]
    t = varied(131, 259, seed=2)  # 2 x 3 blocks of 128, the last row and column partial
    for role in ROLES:
        assert_matches_reference(t, recipe, role)
    assert recipe.quantize(t, WEIGHT_FORWARD).scale.shape == (2, 3)
    assert recipe.quantize(t, INPUT_FORWARD).scale.shape == (131, 3)


def test_the_recipes_layouts_and_formats():
    shape = (256, 384)
    t, r, b = RECIPES["tensorwise"], RECIPES["rowwise"], RECIPES["blockwise"]
    assert [t.dtypes[k] for k in ("input", "weight", "grad_output")] == [E4M3, E4M3, E5M2]
    assert all(dtype == E4M3 for recipe in (r, b) for dtype in recipe.dtypes.values())
    assert {t.block(role, shape) for role in ROLES} == {shape}
    assert {role: r.block(role, shape) for role in ROLES} == {role: (1, 384) if role.axis else (256, 1) for role in ROLES}
    assert b.block(WEIGHT_FORWARD, shape) == (128, 128) and b.block(INPUT_FORWARD, shape) == (1, 128)
    assert (r.power_of_two, t.power_of_two, b.power_of_two) == (True, False, False)


def test_rounding_is_to_nearest_even_including_ties_and_subnormals():
    # amax 448 makes the scale exactly 1, so the values below are cast as they are.
    ties = [448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9 * 0.49, -1.0625, 0.0]
    expected = [448.0, 1.0, 1.25, 0.0, 2.0 ** -8, 0.0, -1.0, 0.0]
    q = quantize_blocks(torch.tensor([ties]), (1, len(ties)), E4M3)
    assert q.scale.item() == 1.0
    assert q.data.float().tolist() == [expected]
    # e5m2 at scale 1 (amax 57344): 2 mantissa bits, ties between 1.0 and 1.25 and between 1.25 and 1.5.
    q = quantize_blocks(torch.tensor([[57344.0, 1.125, 1.375, 2.0 ** -17]]), (1, 4), E5M2)
    assert q.data.float().tolist() == [[57344.0, 1.0, 1.5, 0.0]]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_torchs_cast_rounds_to_nearest_even_within_range(dtype):
    """Every midpoint between neighbouring finite values of the format, and points just beside each, cast by
    ``tensor.to(dtype)`` as the definition says: the recipes rely on torch only within the format's range."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values.double()
    mid = (finite[1:] + finite[:-1]) / 2
    points = torch.cat([finite, mid, mid * (1 + 2.0 ** -20), mid * (1 - 2.0 ** -20)]).float()
    points = torch.cat([points, -points])
    expected = torch.tensor([round_fp8(v, dtype) for v in points.tolist()])
    assert torch.equal(points.to(dtype).float(), expected)


def test_what_torchs_cast_does_beyond_the_range():
    """Out-of-range values: torch 2.12+ saturates e4m3fn in eager mode (inf too: 448) and overflows e5m2 to inf;
    up to 2.11 eager casts did not saturate (torchao float8_utils.py ``to_fp8_saturated``: e4m3fn gave NaN).
    The recipes clamp first (``saturating_cast``), so they give +-448 / +-57344 on every version."""
    big = torch.tensor([1000.0, -1000.0, float("inf")])
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 12):
        assert big.to(E4M3).float().tolist() == [448.0, -448.0, 448.0]
        assert (big * 1000).to(E5M2).float().tolist() == [float("inf"), float("-inf"), float("inf")]
    assert saturating_cast(big, E4M3).float().tolist() == [448.0, -448.0, 448.0]
    assert saturating_cast(big * 1000, E5M2).float().tolist() == [57344.0, -57344.0, 57344.0]
    assert math.isnan(saturating_cast(torch.tensor([float("nan")]), E4M3).float().item())


def test_a_zero_block_keeps_finite_scales_and_zero_values():
    for recipe in RECIPES.values():
        q = recipe.quantize(torch.zeros(3, 130), INPUT_FORWARD)
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
        assert torch.equal(recipe.dequantize(q), torch.zeros(3, 130))


def test_rowwise_scales_are_powers_of_two_that_keep_the_row_amax_in_range():
    t = varied(16, 40, seed=3)
    q = RECIPES["rowwise"].quantize(t, INPUT_FORWARD)
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()  # a power of two
    amax = t.abs().amax(1, keepdim=True)
    fp8_max = FORMATS[E4M3][2]
    assert (amax / q.scale <= fp8_max).all() and (amax / q.scale > fp8_max / 2).all()  # the smallest such power
    assert (q.data.float().abs().amax(1) <= fp8_max).all()


def test_saturation_keeps_a_block_maximum_representable():
    """x * (1 / scale) of the block's largest value may round above 448 in float32; it must come out 448."""
    t = torch.tensor([[447.99, 1.0, -3.0], [1e-3, 5.0, 7.0]]) * 1.0000001
    q = RECIPES["tensorwise"].quantize(t, INPUT_FORWARD)
    assert q.data.float().abs().max().item() == 448.0
