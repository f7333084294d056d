"""The sharded-scale property, on one process: a tensor quantized as two shards, each reducing its amaxes with the
other's (a simulated all-reduce(MAX)) where the recipe's scales span the sharded dimension, gives the FP8 bytes
and scales of the whole tensor; with per-shard scales instead it does not (so the claim can fail). Then a
column-parallel linear (W by output rows, dy by output columns) simulated on two "ranks" against the whole."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from compiler.fp8 import RECIPES, LinearShards, Shards, fp8_linear
from compiler.fp8.linear import quantize_operand
from compiler.fp8.tensor import ROLES

CASES = [(name, role, dim) for name in RECIPES for role in ROLES for dim in (0, 1)]


def uneven(rows: int, cols: int, *, seed: int) -> torch.Tensor:
    """Random values whose second half of rows, and of columns, is 8x larger: every shard has its own amax."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g)
    t[rows // 2:] *= 8
    t[:, cols // 2:] *= 8
    return t


class SimulatedMax:
    """all_reduce(MAX) among in-process "ranks" that make the same sequence of calls: a recording pass collects
    each call's local amaxes, a replay pass answers every rank's k-th call with the MAX of all ranks' k-th."""

    def __init__(self) -> None:
        self.recorded: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.replaying = False

    def hook(self):
        calls = itertools.count()

        def reduce(amax: torch.Tensor) -> torch.Tensor:
            k = next(calls)
            if not self.replaying:
                self.recorded[k].append(amax)
                return amax
            return torch.stack(self.recorded[k]).amax(0)

        return reduce


def quantize_as_shards(recipe, role, t: torch.Tensor, dim: int, *, reduce: bool):
    pieces = t.chunk(2, dim)
    group = SimulatedMax()
    for piece in pieces:
        quantize_operand(recipe, piece, role, shards=(Shards(dim, group.hook()),))
    group.replaying = reduce
    return [quantize_operand(recipe, piece, role, shards=(Shards(dim, group.hook() if reduce else lambda a: a),))
            for piece in pieces]


def bytes_of(q) -> torch.Tensor:
    return q.data.view(torch.uint8)


@pytest.mark.parametrize("name,role,dim", CASES)
def test_shards_with_reduced_amaxes_quantize_as_the_whole(name, role, dim):
    recipe = RECIPES[name]
    t = uneven(256, 512, seed=1)
    whole = recipe.quantize(t, role)
    shards = quantize_as_shards(recipe, role, t, dim, reduce=True)
    assert torch.equal(torch.cat([bytes_of(q) for q in shards], dim), bytes_of(whole))
    if recipe.shards_share_scales(role, dim):
        assert all(torch.equal(q.scale, whole.scale) for q in shards)
    else:
        assert torch.equal(torch.cat([q.scale for q in shards], dim), whole.scale)


@pytest.mark.parametrize("name,role,dim", CASES)
def test_per_shard_scales_differ_exactly_where_the_recipe_says_scales_are_shared(name, role, dim):
    recipe = RECIPES[name]
    t = uneven(256, 512, seed=2)
    whole = recipe.quantize(t, role)
    shards = quantize_as_shards(recipe, role, t, dim, reduce=False)
    same = torch.equal(torch.cat([bytes_of(q) for q in shards], dim), bytes_of(whole))
    assert same != recipe.shards_share_scales(role, dim)


def test_the_recipes_say_which_dimensions_share_scales():
    tensorwise, rowwise, blockwise = (RECIPES[n] for n in ("tensorwise", "rowwise", "blockwise"))
    assert all(tensorwise.shards_share_scales(role, dim) for role in ROLES for dim in (0, 1))
    assert all(rowwise.shards_share_scales(role, dim) == (dim == role.axis) for role in ROLES for dim in (0, 1))
    assert not any(blockwise.shards_share_scales(role, dim) for role in ROLES for dim in (0, 1))


def test_a_shard_that_splits_blocks_is_refused():
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_operand(RECIPES["blockwise"], torch.ones(8, 200), ROLES[0], shards=(Shards(1, lambda a: a),))


def column_parallel(recipe, x, w, b, dy, *, reduce: bool):
    """Two ranks each holding half of W's rows (and of b, y, dy's columns); x whole. Returns y, dx (the partial
    sums added, as the all-reduce would), dW and db."""
    group_w, group_dy = SimulatedMax(), SimulatedMax()
    results = []
    for replay in (False, True):
        group_w.replaying = group_dy.replaying = replay and reduce
        results = []
        for w_i, b_i, dy_i in zip(w.chunk(2), b.chunk(2), dy.chunk(2, 1)):
            shards = LinearShards(weight=(Shards(0, group_w.hook()),), grad_output=(Shards(1, group_dy.hook()),))
            x_i, w_i, b_i = (t.clone().requires_grad_() for t in (x, w_i, b_i))
            y_i = fp8_linear(x_i, w_i, b_i, recipe, shards=shards)
            y_i.backward(dy_i)
            results.append((y_i.detach(), x_i.grad, w_i.grad, b_i.grad))
    y, dx, dw, db = zip(*results)
    return torch.cat(y, 1), dx[0] + dx[1], torch.cat(dw), torch.cat(db)


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_column_parallel_linear_matches_the_whole_exactly_when_it_reduces(name):
    """W's second half of rows is 2^14 x larger and dy's first half of columns too, so both halves of dx = dy W
    matter. Without the reduction, tensorwise scales each shard apart; rowwise's power-of-two scales then differ
    from the whole's by a power of two, which changes no value in the normal range (scaling by 2^j commutes with
    rounding) but does change those the whole's scale pushes below it: hence the spread."""
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(3)
    spread = 2.0 ** 14
    x, b = torch.randn(48, 384, generator=g), torch.randn(256, generator=g)
    w = torch.randn(256, 384, generator=g) * 0.05
    w[128:] *= spread
    dy = torch.randn(48, 256, generator=g) * 1e-2
    dy[:, :128] *= spread
    x_, w_, b_ = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x_, w_, b_, recipe)
    y.backward(dy)
    whole = (y.detach(), x_.grad, w_.grad, b_.grad)

    def difference(reduce: bool) -> float:
        """The largest difference from the whole, relative to each result's magnitude."""
        shards = column_parallel(recipe, x, w, b, dy, reduce=reduce)
        return max(((s - t).abs().max() / t.abs().max()).item() for s, t in zip(shards, whole))

    assert difference(True) < 1e-5  # float32 accumulation order alone
    if name != "blockwise":  # blockwise shares no scale across 128-aligned shards: nothing to reduce
        assert difference(False) > 1e-3
