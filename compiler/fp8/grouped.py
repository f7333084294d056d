"""A mixture's experts in FP8: ``fp8_grouped_mm``, the grouped product of models/common/grouped_mm.py with its three
products per expert in FP8, and the SwiGLU experts built on it (``fp8_experts_swiglu``, ``experts_swiglu``'s twin).

x (M, K) rows sorted by expert, w (E, N, K), offsets (E,) int32 cumulative row counts (rows past offsets[-1]
give zeros) -> (M, N), out[r] = x[r] @ w[e]^T for the rows r of expert e. Each expert's product is quantized as
a linear of its own (linear.py): x_e = x[rows of e] and W_e = w[e] are the operands, so tensorwise scales are per
expert, rowwise per token and per (expert, channel), blockwise tiles never straddle two experts (DeepGEMM's
grouped kernels align each group the same way).

Sources. Under expert parallelism an expert's rows come from several ranks' micro-batches, which a one-process
run quantizes apart. ``sources`` (E, S) says how many of expert e's rows came from source s (source-minor within
each expert, expert_parallel.py's expert-major order): each (expert, source) segment is then quantized as a
linear of its own, so its scales are those of that micro-batch's rows of the expert, and the weight gradient is
the sum of the segments' products, as the one process's accumulation over micro-batches. ``token_reduce``: the
rows of one micro-batch are themselves split over ranks (the sequence shards of context parallelism, or of
sequence parallelism when each mp rank routes its own tokens); the scales that span tokens (tensorwise, rowwise's
weight gradient) take the MAX of every segment's amax over those ranks, computed for all S segments at once (one
all-reduce per tensor and product, empty segments included, so that every rank makes the same calls).
Blockwise's 128-token tiles of the weight gradient cannot be cut across ranks: it refuses ``token_reduce``.

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
from compiler.fp8.linear import LinearShards, Shards, backward_products, forward_product
from compiler.fp8.quantize import AmaxReduce, block_amax
from compiler.fp8.recipe import Recipe, autocast_dtype, autocast_off
from compiler.fp8.tensor import (
    GRAD_DGRAD,
    GRAD_WGRAD,
    INPUT_FORWARD,
    INPUT_WGRAD,
    Role,
    grid_shape,
)
from models import GroupedExperts, MoE


def expert_rows(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows (one host sync)."""
    ends = offsets.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)) if end > start]


def segment_rows(offsets: torch.Tensor, sources: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every (expert, source) segment, empty ones included, expert-major."""
    if sources is None:
        ends = offsets.tolist()
        experts = range(len(ends))
    else:
        ends = sources.flatten().cumsum(0).tolist()
        experts = [e for e in range(sources.shape[0]) for _ in range(sources.shape[1])]
    return list(zip(experts, [0, *ends[:-1]], ends))


def _shared_role(recipe: Recipe, roles: tuple[Role, ...]) -> Role | None:
    """The role among ``roles`` whose scales span tokens (all such roles of a recipe share one layout), or None."""
    spanning = [r for r in roles if recipe.shards_share_scales(r, 0)]
    if not spanning:
        return None
    if any(recipe.blocks[r] != recipe.blocks[spanning[0]] for r in spanning):
        raise ValueError(f"--fp8 {recipe.name}: two layouts span tokens in one product")
    return spanning[0]


def _token_shards(t: torch.Tensor, segments: list[tuple[int, int, int]], recipe: Recipe, roles: tuple[Role, ...],
                  token_reduce: AmaxReduce | None) -> list[tuple[Shards, ...]]:
    """Per segment, the token shards of ``t``'s quantizations in ``roles``: its amax over the rows every rank holds
    of it (one reduction for all segments), or nothing where no scale spans tokens or nothing is split."""
    role = _shared_role(recipe, roles) if token_reduce is not None else None
    if role is None:
        return [() for _ in segments]
    columns = t.shape[1]
    grid = grid_shape((1, columns), recipe.block(role, (1, columns)))
    local = torch.stack([block_amax(t[start:end], recipe.block(role, (end - start, columns))) if end > start
                         else torch.zeros(grid, device=t.device) for _, start, end in segments])  # (S, 1, gc)
    reduced = token_reduce(local)
    return [(Shards(0, functools.partial(_segment_amax, reduced[s])),) for s in range(len(segments))]


def _segment_amax(reduced: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    assert reduced.shape == local.shape, (reduced.shape, local.shape)
    return reduced


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, sources, recipe, guard, token_reduce, out_dtype):
        ctx.save_for_backward(x, w, offsets, sources)
        ctx.recipe, ctx.guard, ctx.token_reduce, ctx.out_dtype = recipe, guard, token_reduce, out_dtype
        out = x.new_zeros(x.shape[0], w.shape[1], dtype=out_dtype)
        if x.device.type == "meta":
            return out
        with autocast_off(x.device.type):
            fast = scaled_grouped_forward(x, w, offsets, groups=expert_rows(offsets), recipe=recipe,
                                          out_dtype=out_dtype, guard=guard)
            if fast is not None:  # rowwise: per-row scales, the same whatever the segments
                return fast
            segments = segment_rows(offsets, sources)
            token_shards = _token_shards(x, segments, recipe, (INPUT_FORWARD,), token_reduce)
            for (e, start, end), shards in zip(segments, token_shards):
                if end > start:
                    out[start:end] = forward_product(x[start:end], w[e], recipe, out_dtype=out_dtype,
                                                     shards=LinearShards(input=shards), guard=guard)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets, sources = ctx.saved_tensors
        needs = ctx.needs_input_grad[:2]
        dx = torch.zeros_like(x) if needs[0] else None
        dw = torch.zeros_like(w) if needs[1] else None
        if x.device.type != "meta":
            grad = grad.contiguous()
            recipe, reduce = ctx.recipe, ctx.token_reduce
            with autocast_off(x.device.type):
                segments = segment_rows(offsets, sources)
                x_shards = _token_shards(x, segments, recipe, (INPUT_WGRAD,), reduce if needs[1] else None)
                grad_shards = _token_shards(grad, segments, recipe, (GRAD_DGRAD, GRAD_WGRAD), reduce)
                for (e, start, end), x_s, grad_s in zip(segments, x_shards, grad_shards):
                    if end == start:
                        continue
                    dx_e, dw_e = backward_products(grad[start:end], x[start:end], w[e], recipe=recipe,
                                                   out_dtype=ctx.out_dtype, needs=needs, guard=ctx.guard,
                                                   shards=LinearShards(input=x_s, grad_output=grad_s))
                    if dx_e is not None:
                        dx[start:end] = dx_e
                    if dw_e is not None:
                        dw[e] += dw_e.to(dw.dtype)
        return dx, dw, None, None, None, None, None, None


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: Recipe, *,
                   guard: AmaxGuard | None = None, sources: torch.Tensor | None = None,
                   token_reduce: AmaxReduce | None = None) -> torch.Tensor:
    """(M, K) rows sorted by expert, (E, N, K), (E,) int32 cumulative row counts -> (M, N) in the autocast dtype
    where autocast is on, else x's dtype; ``sources`` (E, S) rows of each expert by source and ``token_reduce``
    as the module docstring says."""
    if token_reduce is not None and any(not recipe.shards_share_scales(r, 0) and recipe.blocks[r][0] != 1
                                        for r in (INPUT_WGRAD, GRAD_WGRAD)):
        raise ValueError(f"--fp8 {recipe.name}: an expert's token tiles cannot be split over sequence shards")
    out_dtype = autocast_dtype(x.device.type) or x.dtype
    return _Fp8GroupedMM.apply(x, w, offsets, sources, recipe, guard, token_reduce, out_dtype)


def fp8_experts_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                       *, recipe: Recipe, guard: AmaxGuard | None = None,
                       token_reduce: AmaxReduce | None = None) -> torch.Tensor:
    """models/common/moe.py ``experts_swiglu`` with FP8 products: x (M, D), counts (E,) rows per expert or (E, S) rows
    per expert and source, w1 / w3 (E, F, D), w2 (E, D, F) -> (M, D)."""
    sources = counts if counts.dim() == 2 else None
    offsets = (counts.sum(1) if sources is not None else counts).cumsum(0, dtype=torch.int32)
    mm = functools.partial(fp8_grouped_mm, offsets=offsets, recipe=recipe, guard=guard, sources=sources,
                           token_reduce=token_reduce)
    h = F.silu(mm(x, w1)) * mm(x, w3)
    return mm(h, w2)  # (M, D)


def fp8_experts_compute(recipe: Recipe, *, guard: AmaxGuard | None = None,
                        token_reduce: AmaxReduce | None = None) -> Callable[..., torch.Tensor]:
    """``fp8_experts_swiglu`` with the recipe bound: ``(x, counts, w1, w3, w2) -> (M, D)``, the signature expert
    parallelism's ``local_compute`` takes (counts (E, S) there: expert_parallel.py ``by_source``)."""
    return functools.partial(fp8_experts_swiglu, recipe=recipe, guard=guard, token_reduce=token_reduce)


def swap_grouped_experts(module: nn.Module, recipe: Recipe, *, guard: AmaxGuard | None = None,
                         token_reduce: AmaxReduce | None = None) -> list[nn.Module]:
    """Make every MoE block's SwiGLU experts (``GroupedExperts``) compute in FP8 (their ``w1``, ``w3``, ``w2``
    Parameters unchanged); returns the experts modules switched. Experts of another kind (gpt-oss's clamped ones with
    biases) keep computing in the run's precision."""
    compute = fp8_experts_compute(recipe, guard=guard, token_reduce=token_reduce)
    switched = []
    for moe in (m for m in module.modules() if isinstance(m, MoE) and type(m.experts) is GroupedExperts):
        experts = moe.experts
        experts.forward = functools.partial(_experts_forward, experts, compute)
        switched.append(experts)
    return switched


def _experts_forward(experts: nn.Module, compute: Callable[..., torch.Tensor], x: torch.Tensor,
                     counts: torch.Tensor) -> torch.Tensor:
    return compute(x, counts, experts.w1, experts.w3, experts.w2)
