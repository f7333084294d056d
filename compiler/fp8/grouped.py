"""A mixture's experts in FP8: ``fp8_grouped_mm``, the grouped product of models/common/grouped_mm.py with its three
products per expert in FP8, and the SwiGLU experts built on it (``fp8_experts_swiglu``, ``experts_swiglu``'s twin).

x (M, K) rows sorted by expert, w (E, N, K), offsets (E,) int32 cumulative row counts (rows past offsets[-1]
give zeros) -> (M, N), out[r] = x[r] @ w[e]^T for the rows r of expert e. Each expert's product is quantized as
a linear of its own (linear.py): x_e = x[rows of e] and W_e = w[e] are the operands, so tensorwise scales are per
expert, rowwise per token and per (expert, channel), blockwise tiles never straddle two experts (DeepGEMM's
grouped kernels align each group the same way). Per-expert scales need no reduction across ranks: expert
parallelism brings all of an expert's rows of a step to the rank holding it, and experts are not tensor-parallel.
Under expert parallelism those rows come from several data-parallel ranks' micro-batches, which a one-process
run would quantize apart: the tensorwise scales of x_e and dy_e and the wgrad scales (over the expert's tokens)
then differ from it; the forward and dgrad of rowwise and blockwise, per token, do not.

The products run on ``torch._scaled_grouped_mm`` where grouped_kernels.py finds it runs the recipe (CUDA,
rowwise, bf16 output, every group a multiple of 16 rows), else per expert through ``Recipe.matmul`` (torch's
``_scaled_mm`` or the emulation). The group sizes are read on the host once per call, as the portable
``grouped_mm_by_expert`` does. On the meta device (the engine's trace) only shapes are computed.

Switching a model's experts over: ``swap_grouped_experts`` rebinds each MoE block's ``experts.forward`` (the
parameters stay); with expert parallelism pass ``fp8_experts_compute(recipe)`` as ``apply_expert_parallel``'s
``local_compute`` instead (compiler/parallelize/expert_parallel.py), which rebinds the same forward.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from compiler.fp8.grouped_kernels import scaled_grouped_forward
from compiler.fp8.guard import AmaxGuard
from compiler.fp8.linear import backward_products, forward_product
from compiler.fp8.recipe import Recipe, autocast_dtype, autocast_off
from models import MoE


def expert_rows(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows (one host sync)."""
    ends = offsets.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)) if end > start]


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, recipe, guard, out_dtype):
        ctx.save_for_backward(x, w, offsets)
        ctx.recipe, ctx.guard, ctx.out_dtype = recipe, guard, out_dtype
        out = x.new_zeros(x.shape[0], w.shape[1], dtype=out_dtype)
        if x.device.type == "meta":
            return out
        with autocast_off(x.device.type):
            groups = expert_rows(offsets)
            fast = scaled_grouped_forward(x, w, offsets, groups=groups, recipe=recipe, out_dtype=out_dtype, guard=guard)
            if fast is not None:
                return fast
            for e, start, end in groups:
                out[start:end] = forward_product(x[start:end], w[e], recipe, out_dtype=out_dtype, guard=guard)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        needs = ctx.needs_input_grad[:2]
        dx = torch.zeros_like(x) if needs[0] else None
        dw = torch.zeros_like(w) if needs[1] else None
        if x.device.type != "meta":
            grad = grad.contiguous()
            with autocast_off(x.device.type):
                for e, start, end in expert_rows(offsets):
                    dx_e, dw_e = backward_products(grad[start:end], x[start:end], w[e], recipe=ctx.recipe,
                                                   out_dtype=ctx.out_dtype, needs=needs, guard=ctx.guard)
                    if dx_e is not None:
                        dx[start:end] = dx_e
                    if dw_e is not None:
                        dw[e] = dw_e
        return dx, dw, None, None, None, None


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: Recipe, *,
                   guard: AmaxGuard | None = None) -> torch.Tensor:
    """(M, K) rows sorted by expert, (E, N, K), (E,) int32 cumulative row counts -> (M, N) in the autocast dtype
    where autocast is on, else x's dtype (module docstring)."""
    out_dtype = autocast_dtype(x.device.type) or x.dtype
    return _Fp8GroupedMM.apply(x, w, offsets, recipe, guard, out_dtype)


def fp8_experts_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                       *, recipe: Recipe, guard: AmaxGuard | None = None) -> torch.Tensor:
    """models/common/moe.py ``experts_swiglu`` with FP8 products: x (M, D), counts (E,), w1 / w3 (E, F, D),
    w2 (E, D, F) -> (M, D)."""
    offsets = counts.cumsum(0, dtype=torch.int32)
    h = F.silu(fp8_grouped_mm(x, w1, offsets, recipe, guard=guard)) * fp8_grouped_mm(x, w3, offsets, recipe, guard=guard)
    return fp8_grouped_mm(h, w2, offsets, recipe, guard=guard)  # (M, D)


def fp8_experts_compute(recipe: Recipe, *, guard: AmaxGuard | None = None) -> Callable[..., torch.Tensor]:
    """``fp8_experts_swiglu`` with the recipe bound: ``(x, counts, w1, w3, w2) -> (M, D)``, the signature expert
    parallelism's ``local_compute`` takes."""
    return functools.partial(fp8_experts_swiglu, recipe=recipe, guard=guard)


def swap_grouped_experts(module: nn.Module, recipe: Recipe, *, guard: AmaxGuard | None = None) -> list[nn.Module]:
    """Make every MoE block's experts compute in FP8 (their ``w1``, ``w3``, ``w2`` Parameters unchanged); returns
    the experts modules switched."""
    compute = fp8_experts_compute(recipe, guard=guard)
    switched = []
    for moe in (m for m in module.modules() if isinstance(m, MoE)):
        experts = moe.experts
        experts.forward = functools.partial(_experts_forward, experts, compute)
        switched.append(experts)
    return switched


def _experts_forward(experts: nn.Module, compute: Callable[..., torch.Tensor], x: torch.Tensor,
                     counts: torch.Tensor) -> torch.Tensor:
    return compute(x, counts, experts.w1, experts.w3, experts.w2)
