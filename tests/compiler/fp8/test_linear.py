"""compiler/fp8/linear.py: ``fp8_linear``'s output and three gradients against (1) float32 products of the same
quantized operands (the recipe's definition: tolerance as in test_kernels.py) and (2) plain float32, within the
formats' error bound; its dtypes under autocast; the numerics guard.

The float32 bound, derived: each dequantized element errs by e <= 2^-(m+1) |x| + 2^(emin-m-1) s (round to nearest
with m mantissa bits: e4m3 2^-4 |x|, e5m2 2^-3 |x|; below the normal range a fixed half step in units of the block
scale s; reference.py ``element_error_bound``), so for y = sum_k x_k w_k,
|x^ w^ - x w| <= e_x |w| + |x| e_w + e_x e_w per term, and |y^ - y| <= e_x @ |w| + |x| @ e_w + e_x @ e_w plus the
float32 accumulation of both sides (2 (K + 3) u (|x^| @ |w^|)).
"""

from __future__ import annotations

import pytest
import torch

from compiler import torch_compat
from compiler.fp8 import RECIPES, AmaxGuard, fp8_linear
from compiler.fp8.tensor import GRAD_DGRAD, GRAD_WGRAD, INPUT_FORWARD, INPUT_WGRAD, WEIGHT_DGRAD, WEIGHT_FORWARD
from tests.compiler.fp8.reference import element_error_bound
from tests.compiler.fp8.test_kernels import U

M, K, N = 40, 300, 136  # partial 128-blocks in K and N


def tensors(seed: int = 0):
    """Rows and columns spanning 2^12 in magnitude: scaling along the wrong axis then sends other values below
    e4m3's normal range (power-of-two scales along either axis give the same normal values: compiler/fp8/README.md)."""
    g = torch.Generator().manual_seed(seed)

    def spread(*shape):
        return torch.exp2(-torch.randint(0, 13, shape, generator=g).float())

    x = torch.randn(M, K, generator=g) * spread(M, 1) * spread(1, K)
    w = torch.randn(N, K, generator=g) * 0.05 * spread(N, 1) * spread(1, K)
    b = torch.randn(N, generator=g)
    dy = torch.randn(M, N, generator=g) * spread(M, 1) * spread(1, N) * 1e-2
    return x, w, b, dy


def run(recipe, x, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, recipe)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def products(recipe, x, w, dy):
    """The three products' operand pairs, quantized by the recipe: (forward), (dgrad), (wgrad)."""
    q = recipe.quantize
    return [(q(x, INPUT_FORWARD), q(w, WEIGHT_FORWARD).t()), (q(dy, GRAD_DGRAD), q(w, WEIGHT_DGRAD)),
            (q(dy, GRAD_WGRAD).t(), q(x, INPUT_WGRAD))]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_output_and_gradients_are_the_products_of_the_quantized_operands(name):
    recipe = RECIPES[name]
    x, w, b, dy = tensors()
    y, dx, dw, db = run(recipe, x, w, b, dy)
    for got, (a, c), bias in zip((y, dx, dw), products(recipe, x, w, dy), (b, 0, 0)):
        expected = a.dequantize() @ c.dequantize() + bias
        tolerance = 2 * (a.shape[1] + 3) * U * (a.dequantize().abs() @ c.dequantize().abs() + abs(bias))
        assert got.shape == expected.shape
        assert ((got - expected).abs() <= tolerance).all()
    assert torch.allclose(db, dy.sum(0), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_all_three_products_run_on_torchs_kernel_on_this_cpu(name, monkeypatch):
    """torch 2.13's CPU ``_scaled_mm`` takes tensorwise and rowwise scales: every product of the linear reaches it
    (an operand scaled along the wrong axis would not fit the kernel and fall back to the emulation)."""
    calls = []
    real = torch_compat.scaled_mm
    monkeypatch.setattr(torch_compat, "scaled_mm", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    run(RECIPES[name], *tensors(5))
    assert len(calls) == 3


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_output_and_gradients_are_within_the_formats_error_of_float32(name):
    recipe = RECIPES[name]
    x, w, b, dy = tensors(1)
    y, dx, dw, _ = run(recipe, x, w, b, dy)
    # Each result, its float32 value and the exact operands in the product's layout: (x, W^T), (dy, W), (dy^T, x).
    cases = [(y, x @ w.t() + b, (x, w.t())), (dx, dy @ w, (dy, w)), (dw, dy.t() @ x, (dy.t(), x))]
    for (got, reference, (left_exact, right_exact)), (a, c) in zip(cases, products(recipe, x, w, dy)):
        left, right = a.dequantize(), c.dequantize()
        e_left = element_error_bound(a.element_scale(), left_exact, a.data.dtype)
        e_right = element_error_bound(c.element_scale(), right_exact, c.data.dtype)
        error = (got - reference).abs()
        bound = (e_left @ right_exact.abs() + left_exact.abs() @ e_right + e_left @ e_right
                 + 2 * (a.shape[1] + 3) * U * (left.abs() @ right.abs() + left_exact.abs() @ right_exact.abs())
                 + U * (got.abs() + reference.abs()))  # the bias's addition, rounded on each side
        assert (error <= bound).all(), (error / bound).max()
        assert error.max() > 0  # FP8 happened


def test_tensorwise_gradients_are_e5m2_and_its_bound_is_e5m2s():
    """The output gradient of tensorwise is e5m2 (2 mantissa bits): its error against float32 exceeds e4m3's
    bound somewhere, so the test above measures the format the recipe claims."""
    recipe = RECIPES["tensorwise"]
    x, w, b, dy = tensors(2)
    q = recipe.quantize(dy, GRAD_DGRAD)
    assert q.data.dtype == torch.float8_e5m2
    e4m3_bound = element_error_bound(q.element_scale(), dy, torch.float8_e4m3fn)
    assert ((q.dequantize() - dy).abs() > e4m3_bound).any()


def test_autocast_output_is_bf16_and_gradients_keep_their_tensors_dtypes():
    recipe = RECIPES["rowwise"]
    x, w, b, dy = tensors(3)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x.view(4, 10, K), w, b, recipe)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 10, N)
    y.backward(dy.view(4, 10, N).bfloat16())
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.float32,) * 3
    # The product rounded once to bf16, then the bias added in bf16 (as autocast's linear would); the kernel's
    # float32 sum may round to a neighbouring bf16 value (one ulp of the product, one of the result).
    product = fp8_linear(x.detach(), w.detach(), None, recipe)
    expected = (product.bfloat16() + b.detach().bfloat16()).float()
    tolerance = 2.0 ** -7 * (product.abs() + expected.abs())
    assert ((y.float().view(M, N) - expected).abs() <= tolerance).all()


def test_the_guard_flags_a_non_finite_amax_and_resets():
    recipe = RECIPES["tensorwise"]
    guard = AmaxGuard()
    x, w, b, _ = tensors(4)
    fp8_linear(x, w, b, recipe, guard=guard)
    assert guard.take().item() == 0.0 and guard.take() is None
    x[3, 7] = float("inf")
    fp8_linear(x, w, b, recipe, guard=guard)
    assert guard.take().item() == 1.0
    dy = torch.full((M, N), float("nan"))
    x = x.clone().fill_(1.0).requires_grad_()
    fp8_linear(x, w, b, recipe, guard=guard).backward(dy)
    assert guard.take().item() == 1.0  # the output gradient's amax, seen in the backward


def test_a_linear_on_the_meta_device_gives_shapes():
    w = torch.empty(N, K, device="meta", requires_grad=True)
    x = torch.empty(3, M, K, device="meta", requires_grad=True)
    y = fp8_linear(x, w, None, RECIPES["blockwise"])
    assert y.shape == (3, M, N) and y.device.type == "meta"
    y.sum().backward()
    assert w.grad.shape == (N, K)


def test_the_guard_makes_the_same_calls_in_a_selective_checkpoints_recomputation():
    """Selective checkpointing numbers a block's op calls and its recomputation must make the same ones: a guard
    whose first observation of a step (inside the block) ran one ``torch.maximum`` fewer than the recomputation
    (which finds the flag set) failed the backward ("invocation index ... not found in storage")."""
    from torch.utils.checkpoint import checkpoint

    from compiler.parallelize.activation_checkpointing import selective_checkpoint_contexts

    recipe, guard = RECIPES["rowwise"], AmaxGuard()
    x, w, b, _ = tensors(5)
    x.requires_grad_()
    checkpoint(fp8_linear, x, w, b, recipe, guard=guard, use_reentrant=False,
               context_fn=selective_checkpoint_contexts).sum().backward()
    assert x.grad is not None and guard.take().item() == 0.0
