"""compiler/fp8/grouped.py: the experts' grouped product in FP8 against a loop of per-expert FP8 linears (forward
and both gradients), against the models' high-precision grouped product, and switched into an MoE model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiler.fp8 import RECIPES, fp8_experts_compute, fp8_grouped_mm, fp8_linear, swap_grouped_experts
from models import MoE, build_model, experts_swiglu, named_config

COUNTS = [10, 0, 25, 15]  # an expert without rows
M, K, N = 55, 96, 160  # 5 rows past the last expert's: padding, zeros out


def operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(len(COUNTS), N, K, generator=g) * torch.rand(len(COUNTS), 1, 1, generator=g)
    dy = torch.randn(M, N, generator=g)
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    return x, w, offsets, dy


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_grouped_product_is_a_loop_of_fp8_linears(name):
    recipe = RECIPES[name]
    x, w, offsets, dy = operands()
    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(x_, w_, offsets, recipe)
    out.backward(dy)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            x_e, w_e = x[start:end].clone().requires_grad_(), w[e].clone().requires_grad_()
            y_e = fp8_linear(x_e, w_e, None, recipe)
            y_e.backward(dy[start:end])
            assert torch.equal(out[start:end], y_e)
            assert torch.equal(x_.grad[start:end], x_e.grad)
            assert torch.equal(w_.grad[e], w_e.grad)
        else:
            assert torch.equal(w_.grad[e], torch.zeros_like(w[e]))  # an expert without rows gets no gradient
        start = end
    assert torch.equal(out[start:], torch.zeros(M - start, N)) and torch.equal(x_.grad[start:], torch.zeros(M - start, K))


def test_the_grouped_product_is_close_to_the_high_precision_one():
    from models.common.grouped_mm import grouped_mm

    x, w, offsets, _ = operands(1)
    reference = grouped_mm(x, w, offsets)
    for recipe in RECIPES.values():
        out = fp8_grouped_mm(x, w, offsets, recipe)
        assert ((out - reference).abs().max() / reference.abs().max()).item() < 0.05


def test_fp8_experts_take_the_portable_experts_arguments():
    x, _, _, _ = operands(2)
    counts = torch.tensor(COUNTS)
    g = torch.Generator().manual_seed(3)
    experts, width = len(COUNTS), 64
    w1, w3 = (torch.randn(experts, width, K, generator=g) * 0.1 for _ in range(2))  # (E, F, D)
    w2 = torch.randn(experts, K, width, generator=g) * 0.1  # (E, D, F)
    compute = fp8_experts_compute(RECIPES["rowwise"])
    out = compute(x, counts, w1, w3, w2)
    reference = experts_swiglu(x, counts, w1, w3, w2)
    assert out.shape == reference.shape == (M, K)
    # One FP8 product of Gaussian operands errs by about 3.6% rms (two e4m3 roundings, each uniform within +-2^-4
    # relative: 2^-4 / sqrt(3) each); the SwiGLU chains three (here 6-7%).
    assert ((out - reference).norm() / reference.norm()).item() < 0.1


def test_an_moe_models_experts_switch_to_fp8_and_train():
    torch.manual_seed(0)
    model = build_model(named_config("qwen3-moe-debug"), seed=0)
    tokens = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        reference = model(tokens[:, :-1])
    switched = swap_grouped_experts(model, RECIPES["blockwise"])
    assert len(switched) == sum(isinstance(m, MoE) for m in model.modules()) == 2
    assert [name for name, _ in switched[0].named_parameters()] == ["w1", "w3", "w2"]
    with torch.no_grad():
        fp8 = model(tokens[:, :-1])
    assert not torch.equal(fp8, reference) and ((fp8 - reference).abs().max() / reference.abs().max()).item() < 0.05
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in switched[0].parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_the_grouped_product_on_the_meta_device_gives_shapes():
    x = torch.empty(M, K, device="meta", requires_grad=True)
    w = torch.empty(len(COUNTS), N, K, device="meta", requires_grad=True)
    out = fp8_grouped_mm(x, w, torch.empty(len(COUNTS), dtype=torch.int32, device="meta"), RECIPES["tensorwise"])
    assert out.shape == (M, N) and out.device.type == "meta"
    out.sum().backward()
    assert x.grad.shape == (M, K) and w.grad.shape == w.shape
