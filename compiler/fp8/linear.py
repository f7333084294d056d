"""y = x W^T (+ b) with its three products in FP8: ``fp8_linear``, an autograd function.

Forward: x and W quantized (their forward roles, tensor.py), y = x_q @ W_q^T in the output dtype, the bias added
after in that dtype. Backward: dy quantized in the recipe's gradient format (e5m2 for tensorwise, e4m3 otherwise),
dx = dy_q @ W_q' and dW = dy_q'^T @ x_q', each operand quantized in its role for that product (rowwise and
blockwise scale along a different axis than the forward; a tensorwise quantization serves both products). The
backward quantizes from the saved high-precision x and W, as torchao does (torchao float8_linear.py), so the
weight's FP8 copy is not kept from the forward (with FSDP it would be the unsharded weight).

Output dtype: the autocast dtype where autocast is on (the product a ``nn.Linear`` under autocast runs in), else
x's dtype. dx and dW come out in that dtype and are cast to x's and W's, as autocast's casts would; the bias's
gradient is summed in float32.

Shards. When a rank holds a shard of x, W or dy (``Shards``: the dimension of its 2-D layout, x and dy
(tokens, features), W (out, in), and a MAX over the ranks holding the other shards), each quantization applies
that MAX to its local amaxes exactly when its scales span the sharded dimension (``Recipe.shards_share_scales``),
so the FP8 bytes and scales are those of the whole tensor: see compiler/fp8/README.md for the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.fp8.fsdp_all_gather import GatheredFp8Weight
from compiler.fp8.guard import AmaxGuard
from compiler.fp8.quantize import AmaxReduce
from compiler.fp8.recipe import Recipe, autocast_dtype, autocast_off
from compiler.fp8.tensor import GRAD_DGRAD, GRAD_WGRAD, INPUT_FORWARD, INPUT_WGRAD, WEIGHT_DGRAD, WEIGHT_FORWARD, Fp8Tensor, Role


@dataclass(frozen=True)
class Shards:
    """This rank holds one shard of a tensor along ``dim``; ``amax_reduce`` is MAX over the ranks holding the
    others (the engine passes an all-reduce(MAX) over that mesh dimension's group)."""

    dim: int
    amax_reduce: AmaxReduce


@dataclass(frozen=True)
class LinearShards:
    """How the three tensors of a linear are sharded on this rank (empty: held whole)."""

    input: tuple[Shards, ...] = ()
    weight: tuple[Shards, ...] = ()
    grad_output: tuple[Shards, ...] = ()


def quantize_operand(recipe: Recipe, t: torch.Tensor, role: Role, *, shards: tuple[Shards, ...] = (),
                     guard: AmaxGuard | None = None) -> Fp8Tensor:
    """``recipe.quantize`` with the MAX over each sharded dimension whose scales span it (composed, for a tensor
    sharded along both dimensions); ValueError where a shard would split fixed-size blocks. A weight FSDP gathered
    in FP8 (fsdp_all_gather.py) is already quantized with the whole weight's scale: its bytes are used as they are."""
    if isinstance(t, GatheredFp8Weight):
        if recipe.block(role, tuple(t.shape)) != tuple(t.shape):
            raise ValueError(f"--fp8 {recipe.name}: a weight all-gathered in FP8 has one scale per tensor; this recipe "
                             f"scales it in blocks of {recipe.block(role, tuple(t.shape))}")
        return t.fp8()
    reduces = []
    for shard in shards:
        if recipe.shards_share_scales(role, shard.dim):
            reduces.append(shard.amax_reduce)
        else:
            recipe.check_shard(role, shard.dim, t.shape[shard.dim])

    def reduce_all(amax: torch.Tensor) -> torch.Tensor:
        for reduce in reduces:
            amax = reduce(amax)
        return amax

    return recipe.quantize(t, role, amax_reduce=reduce_all if reduces else None, guard=guard)


def forward_product(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, *, out_dtype: torch.dtype,
                    shards: LinearShards = LinearShards(), guard: AmaxGuard | None = None) -> torch.Tensor:
    """x (M, K), W (N, K) -> x W^T (M, N)."""
    x_q = quantize_operand(recipe, x, INPUT_FORWARD, shards=shards.input, guard=guard)
    w_q = quantize_operand(recipe, weight, WEIGHT_FORWARD, shards=shards.weight, guard=guard)
    return recipe.matmul(x_q, w_q.t(), out_dtype)


def backward_products(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, recipe: Recipe,
                      out_dtype: torch.dtype, needs: tuple[bool, bool], shards: LinearShards = LinearShards(),
                      guard: AmaxGuard | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dy (M, N), x (M, K), W (N, K) -> (dx = dy W (M, K), dW = dy^T x (N, K)), each only where ``needs`` says."""
    grad_dgrad = quantize_operand(recipe, grad, GRAD_DGRAD, shards=shards.grad_output, guard=guard)
    dx = dw = None
    if needs[0]:
        w_q = quantize_operand(recipe, weight, WEIGHT_DGRAD, shards=shards.weight, guard=guard)
        dx = recipe.matmul(grad_dgrad, w_q, out_dtype)
    if needs[1]:
        same_layout = recipe.blocks[GRAD_WGRAD] == recipe.blocks[GRAD_DGRAD]  # tensorwise: one quantization of dy
        grad_wgrad = grad_dgrad if same_layout else quantize_operand(recipe, grad, GRAD_WGRAD, shards=shards.grad_output,
                                                                     guard=guard)
        x_q = quantize_operand(recipe, x, INPUT_WGRAD, shards=shards.input, guard=guard)
        dw = recipe.matmul(grad_wgrad.t(), x_q, out_dtype)
    return dx, dw


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, shards, guard, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.shards, ctx.guard, ctx.out_dtype = recipe, shards, guard, out_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        with autocast_off(x.device.type):
            y = forward_product(x, weight, recipe, out_dtype=out_dtype, shards=shards, guard=guard)
            return y if bias is None else y + bias.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with autocast_off(grad.device.type):
            dx, dw = backward_products(grad.contiguous(), x, weight, recipe=ctx.recipe, out_dtype=ctx.out_dtype,
                                       needs=needs[:2], shards=ctx.shards, guard=ctx.guard)
            db = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if needs[2] else None
        dx = None if dx is None else dx.to(x.dtype)
        dw = None if dw is None else dw.to(weight.dtype)
        return dx, dw, db, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, *,
               shards: LinearShards = LinearShards(), guard: AmaxGuard | None = None) -> torch.Tensor:
    """x (..., K), W (N, K), b (N,) or None -> (..., N) (module docstring)."""
    out_dtype = autocast_dtype(x.device.type) or x.dtype
    rows = x.reshape(-1, x.shape[-1])
    y = _Fp8Linear.apply(rows, weight, bias, recipe, shards, guard, out_dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
