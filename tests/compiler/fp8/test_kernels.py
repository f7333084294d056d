"""compiler/fp8/kernels.py: torch's ``_scaled_mm`` (tensorwise and rowwise run on this CPU build) against the
recipes' emulation, and the probe that decides which to use.

Tolerance, derived. Both compute S_ij = sum_k A_ik B_kj over the same FP8 values and float32 scales (A, B the
dequantized operands). The emulation rounds each dequantized element once (relative error <= u = 2^-24), so each
product errs by <= 2u + u^2 relative, and sums K of them in float32: <= gamma_(K-1) sum_k |A_ik B_kj| more, with
gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.4). The kernel forms the
same sum in another order, and applies the scales before or after summing: at most the same bound (plus two
roundings of the scales' product). So |kernel - emulation| <= 2 (K + 3) u (|A| @ |B|) in float32. A bf16 output
rounds each side once more, by <= 2^-8 of its magnitude (bf16 keeps 8 significant bits): add 2^-8 (|kernel| +
|emulation|).
"""

from __future__ import annotations

import pytest
import torch

from compiler import torch_compat
from compiler.fp8 import RECIPES, kernels
from compiler.fp8.recipe import emulated_matmul
from compiler.fp8.tensor import GRAD_DGRAD, GRAD_WGRAD, INPUT_FORWARD, INPUT_WGRAD, WEIGHT_DGRAD, WEIGHT_FORWARD

U = 2.0 ** -24


def accumulation_tolerance(a, b, out: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    k = a.shape[1]
    magnitude = a.dequantize().abs() @ b.dequantize().abs()
    tolerance = 2 * (k + 3) * U * magnitude
    if out.dtype == torch.bfloat16:
        tolerance = tolerance + 2.0 ** -8 * (out.float().abs() + expected.float().abs())
    return tolerance


def operands(recipe, m: int, k: int, n: int, *, seed: int):
    """The three products' operand pairs of a linear: (forward), (dgrad), (wgrad)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    dy = torch.randn(m, n, generator=g) * 1e-3
    q = recipe.quantize
    return [(q(x, INPUT_FORWARD), q(w, WEIGHT_FORWARD).t()),
            (q(dy, GRAD_DGRAD), q(w, WEIGHT_DGRAD)),
            (q(dy, GRAD_WGRAD).t(), q(x, INPUT_WGRAD))]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_agrees_with_the_emulation_within_accumulation_order(name, out_dtype):
    recipe = RECIPES[name]
    for a, b in operands(recipe, 24, 520, 72, seed=0):
        out = kernels.scaled_product(a, b, recipe.kernel, out_dtype=out_dtype)
        assert out is not None, f"{name}: torch._scaled_mm should run on this CPU build"
        expected = emulated_matmul(a, b, out_dtype)
        assert out.dtype == out_dtype
        error = (out.float() - expected.float()).abs()
        assert (error <= accumulation_tolerance(a, b, out, expected)).all(), error.max()


def test_blockwise_runs_as_the_emulation_where_the_kernel_refuses_its_scales():
    """torch 2.13's CPU ``_scaled_mm`` accepts only tensorwise and rowwise scales ("Invalid scaling
    configuration" for 1x128 / 128x128 grids); the recipe then is its emulation, exactly."""
    recipe = RECIPES["blockwise"]
    a, b = operands(recipe, 8, 300, 140, seed=1)[0]
    assert not kernels.kernel_runs(torch.device("cpu"), "blockwise", a_dtype=a.data.dtype, b_dtype=b.data.dtype,
                               out_dtype=torch.float32)
    assert kernels.scaled_product(a, b, "blockwise", out_dtype=torch.float32) is None
    assert torch.equal(recipe.matmul(a, b, torch.float32), a.dequantize() @ b.dequantize())


def test_a_kernel_that_misreads_the_scales_is_not_used(monkeypatch):
    """The probe checks numbers, not only that the call returns: a kernel ignoring the right operand's scales
    (as a misread layout would) is refused and the product is emulated, correctly."""
    real = torch_compat.scaled_mm
    monkeypatch.setattr(kernels, "_PROBED", {})
    monkeypatch.setattr(torch_compat, "scaled_mm",
                        lambda a, b, sa, sb, *, out_dtype: real(a, b, sa, torch.ones_like(sb), out_dtype=out_dtype))
    recipe = RECIPES["rowwise"]
    a, b = operands(recipe, 16, 64, 32, seed=2)[0]
    assert not kernels.kernel_runs(torch.device("cpu"), "rowwise", a_dtype=a.data.dtype, b_dtype=b.data.dtype,
                                   out_dtype=torch.float32)
    assert kernels.scaled_product(a, b, "rowwise", out_dtype=torch.float32) is None
    assert torch.allclose(recipe.matmul(a, b, torch.float32), emulated_matmul(a, b, torch.float32))


def test_the_probe_leaves_the_global_random_stream_alone(monkeypatch):
    monkeypatch.setattr(kernels, "_PROBED", {})
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    kernels.kernel_runs(torch.device("cpu"), "tensorwise", a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn,
                        out_dtype=torch.float32)
    assert torch.equal(torch.rand(3), expected)


def test_kernel_layouts_row_major_left_column_major_right(monkeypatch):
    """What reaches ``_scaled_mm``: the left operand row-major, the right column-major (CUDA needs it), rowwise
    scales with unit strides on their unit dimension (a transposed (1, N) grid arrives as (N, 1) with stride N)."""
    seen = []
    real = torch_compat.scaled_mm

    def spy(a, b, sa, sb, *, out_dtype):
        seen.append((a.stride(1), b.stride(0), sa.stride(), sb.stride()))
        return real(a, b, sa, sb, out_dtype=out_dtype)

    monkeypatch.setattr(torch_compat, "scaled_mm", spy)
    recipe = RECIPES["rowwise"]
    for a, b in operands(recipe, 16, 48, 32, seed=3):
        recipe.matmul(a, b, torch.float32)
    assert seen and all(a_stride == 1 and b_stride == 1 and sa[1] == 1 and sb[1] == 1 for a_stride, b_stride, sa, sb in seen)


def test_a_probe_under_fake_tensors_runs_on_real_data(monkeypatch):
    """The engine counts FLOPs under FakeTensorMode; a probe reached there must still run its GEMM on real
    tensors (``torch_compat.real_tensors``), not cache a failure from fake ones."""
    monkeypatch.setattr(kernels, "_PROBED", {})
    with torch_compat.FakeTensorMode():
        assert kernels.kernel_runs(torch.device("cpu"), "rowwise", a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn,
                                   out_dtype=torch.float32)


def test_the_grouped_kernel_is_cuda_only_and_the_experts_loop_elsewhere():
    from compiler.fp8.grouped_kernels import scaled_grouped_forward

    assert torch_compat.has_scaled_grouped_mm()  # 2.11 and 2.13 define it; 2.13's CPU build has no kernel for it
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(2, 32, 16).to(torch.float8_e4m3fn).transpose(-2, -1).contiguous().transpose(-2, -1)
    with pytest.raises(NotImplementedError):
        torch_compat.scaled_grouped_mm(a, b, torch.ones(16), torch.ones(2, 16), torch.tensor([8, 16], dtype=torch.int32),
                                       out_dtype=torch.bfloat16)
    x, w = torch.randn(16, 32), torch.randn(2, 16, 32)
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    assert scaled_grouped_forward(x, w, offsets, groups=[(0, 0, 8), (1, 8, 16)], recipe=RECIPES["rowwise"],
                                  out_dtype=torch.bfloat16) is None


def test_a_probe_inside_selective_checkpointing_leaves_its_cache_in_step(monkeypatch):
    """A probe first reached inside a selectively checkpointed block (an FP8 linear's first call, before the router's
    plain product) must be unseen by the checkpoint's caching mode: the recomputation, which probes nothing, takes
    cached ``mm`` outputs by call index, so a counted probe GEMM hands its (32, 256) output to the next product."""
    from torch.utils.checkpoint import checkpoint

    from compiler.parallelize.activation_checkpointing import selective_checkpoint_contexts

    monkeypatch.setattr(kernels, "_PROBED", {})

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        kernels.kernel_runs(x.device, "rowwise", a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn,
                            out_dtype=torch.float32)
        return torch.sin(x @ w)  # (4, 3); sin's backward reads the cached product

    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(5, 3)
    checkpoint(block, x, w, use_reentrant=False, context_fn=selective_checkpoint_contexts).sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x @ w) @ w.t())
