"""compiler/fp8/grouped.py with ``sources`` and ``token_reduce``: an expert's rows from several sources (expert
parallelism's peers) are quantized source by source, as one process quantizes each micro-batch apart, and the weight
gradient is the sum of the sources' products; with ``token_reduce`` (a micro-batch's tokens on several ranks) the
scales spanning tokens take the MAX over the ranks, so two half-token "ranks" give the whole tensor's bytes."""

from __future__ import annotations

import pytest
import torch

from compiler.fp8 import RECIPES, fp8_grouped_mm
from tests.compiler.fp8.test_linear_shards import SimulatedMax

K, N = 96, 160
SOURCES = torch.tensor([[7, 3], [0, 0], [4, 9], [6, 2]])  # (E, S): rows of expert e from source s


def operands(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4
    w = torch.randn(len(SOURCES), N, K, generator=g) * torch.rand(len(SOURCES), 1, 1, generator=g)
    dy = torch.randn(rows, N, generator=g) * torch.rand(rows, 1, generator=g)
    return x, w, dy


def product(x, w, dy, counts, recipe, **kwargs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(x, w, counts.cumsum(0, dtype=torch.int32) if counts.dim() == 1 else
                         counts.sum(1).cumsum(0, dtype=torch.int32), recipe, **kwargs)
    out.backward(dy)
    return out.detach(), x.grad, w.grad


def by_source(t: torch.Tensor, source: int) -> torch.Tensor:
    """Rows of ``source`` out of an expert-major, source-minor layout."""
    starts = SOURCES.flatten().cumsum(0) - SOURCES.flatten()
    return torch.cat([t[int(starts[e * 2 + source]):int(starts[e * 2 + source]) + int(SOURCES[e, source])]
                      for e in range(len(SOURCES))])


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_sources_rows_are_quantized_as_that_sources_own_product(name):
    recipe = RECIPES[name]
    x, w, dy = operands(int(SOURCES.sum()), seed=0)
    out, dx, dw = product(x, w, dy, SOURCES, recipe, sources=SOURCES)
    total = torch.zeros_like(w)
    for s in range(SOURCES.shape[1]):  # one process: each source's micro-batch through the experts apart
        one_out, one_dx, one_dw = product(by_source(x, s), w, by_source(dy, s), SOURCES[:, s], recipe)
        assert torch.equal(by_source(out, s), one_out) and torch.equal(by_source(dx, s), one_dx)
        total += one_dw
    torch.testing.assert_close(dw, total, rtol=1e-6, atol=1e-6)  # a sum of two products, in another order
    if name == "tensorwise":  # the sources' scales differ: quantizing the experts' rows together is another thing
        assert not torch.equal(out, product(x, w, dy, SOURCES.sum(1), recipe)[0])


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_a_token_split_reduced_over_ranks_gives_the_whole_tensors_products(name):
    """Two "ranks" each hold half of every source's rows of every expert (a sequence split in two); with the MAX of
    their amaxes they compute exactly the rows the whole would, and the weight gradients sum to the whole's."""
    recipe = RECIPES[name]
    x, w, dy = operands(int(SOURCES.sum()), seed=1)
    whole_out, whole_dx, whole_dw = product(x, w, dy, SOURCES, recipe, sources=SOURCES)
    halves = SOURCES // 2, SOURCES - SOURCES // 2
    starts = (SOURCES.flatten().cumsum(0) - SOURCES.flatten()).tolist()
    picks = [torch.cat([torch.arange(a + i * h0, a + i * h0 + h) for a, h0, h in
                        zip(starts, halves[0].flatten().tolist(), half.flatten().tolist())]).long()
             for i, half in enumerate(halves)]
    for reduce in (True, False):
        group = SimulatedMax()
        for rank, pick in enumerate(picks):  # record every rank's amaxes (forward and backward)
            product(x[pick], w, dy[pick], halves[rank], recipe, sources=halves[rank], token_reduce=group.hook())
        group.replaying = True
        results = [product(x[pick], w, dy[pick], halves[rank], recipe, sources=halves[rank],
                           token_reduce=group.hook() if reduce else lambda a: a) for rank, pick in enumerate(picks)]
        # The same bytes and scales give the same products up to the GEMM's accumulation order for another M.
        error = max(max(float((out - whole_out[pick]).abs().max()) / float(whole_out.abs().max()),
                        float((dx - whole_dx[pick]).abs().max()) / float(whole_dx.abs().max()))
                    for (out, dx, _), pick in zip(results, picks))
        dw_error = float((results[0][2] + results[1][2] - whole_dw).abs().max()) / float(whole_dw.abs().max())
        if reduce or name == "rowwise":  # rowwise: per-token forward and dgrad scales, powers of two in wgrad
            assert error < 1e-6 and dw_error < 1e-6, (error, dw_error)
        else:  # each rank's own scales: another grid for every element
            assert error > 1e-3 and dw_error > 1e-3, (error, dw_error)


def test_blockwise_refuses_a_token_split_its_tiles_would_straddle():
    x, w, _ = operands(int(SOURCES.sum()), seed=2)
    with pytest.raises(ValueError, match="blockwise.*token tiles"):
        fp8_grouped_mm(x, w, SOURCES.sum(1).cumsum(0, dtype=torch.int32), RECIPES["blockwise"], sources=SOURCES,
                       token_reduce=lambda a: a)
