"""The grouped matrix product of a mixture's experts, as one opaque operator (``torch.ops.moe.grouped_mm``).

Rows of ``x`` (M, K) come sorted by expert: expert e's rows are ``offsets[e-1]:offsets[e]`` (``offsets``
(E,) int32, cumulative counts, ``offsets[-1] <= M``; rows past it are padding and give zeros), and each is
multiplied by its expert's matrix: ``out[r] = x[r] @ w[e].T`` with ``w`` (E, N, K), so out is (M, N). That is
``F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)``, torch's public grouped GEMM (torch 2.10 on; the private
``torch._grouped_mm`` before), which has a fast kernel on CUDA SM90+ in bf16 only; the portable form is one
``mm`` per expert.

Why an operator and not Python: which rows belong to which expert is data (``offsets``), so a loop over the
groups cannot be traced with static shapes, on the meta device (the engine's trace, ``torch.export``) or under
FakeTensorMode (compiler/cost.py counts FLOPs there). As a custom operator it is one node whose output shape
(M, N) is known without its data (``register_fake``), and its backward is two more such nodes. The portable
kernel serves every device; importing this module also registers torch's grouped GEMM as the CUDA kernel, which
takes it where ``grouped_gemm_applies`` (CUDA SM90+, bf16, 16-byte aligned leading strides) and keeps the loop
elsewhere, so a model is as fast with or without the engine. A torch without ``F.grouped_mm`` keeps the loop.

FLOPs, for a cost model (FlopCounterMode cannot see inside): forward 2 M K N; backward the same twice
(``grouped_mm`` for the input's gradient, ``grouped_mm_weight_grad`` for the weights').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMESPACE = "moe"


def grouped_mm_by_expert(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The portable kernel: one ``mm`` per expert with rows."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host sync: the group sizes decide the slices
        if end > start:
            torch.mm(x[start:end], w[e].t(), out=out[start:end])
        start = end
    return out


def weight_grad_by_expert(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The portable kernel of ``grouped_mm_weight_grad``."""
    out = grad.new_zeros(n_groups, grad.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end].t(), x[start:end], out=out[e])
        start = end
    return out


@torch.library.custom_op(f"{NAMESPACE}::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(M, K) rows sorted by expert, (E, N, K) weights, (E,) int32 cumulative row counts -> (M, N)."""
    return grouped_mm_by_expert(x, w, offsets)


@grouped_mm.register_fake
def _grouped_mm_shape(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The gradient of ``grouped_mm``'s weights: (M, N) output gradients, (M, K) inputs -> (E, N, K), expert
    e's block being grad[rows of e].T @ x[rows of e] (zero for an expert without rows)."""
    return weight_grad_by_expert(grad, x, offsets, n_groups)


@grouped_mm_weight_grad.register_fake
def _weight_grad_shape(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_groups: int) -> torch.Tensor:
    return grad.new_empty(n_groups, grad.shape[1], x.shape[1])


def _save_inputs(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad_x = grouped_mm(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None  # (M, K)
    grad_w = grouped_mm_weight_grad(grad, x, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None  # (E, N, K)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_save_inputs)


def grouped_mm_flops(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *args, **kwargs) -> int:
    """2 M K N for ``grouped_mm(x (M, K), w (E, N, K))``: each row meets one expert's matrix, whatever the split."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[1]


def grouped_mm_weight_grad_flops(grad_shape: tuple[int, ...], x_shape: tuple[int, ...], *args, **kwargs) -> int:
    """2 M N K for ``grouped_mm_weight_grad(grad (M, N), x (M, K))``."""
    return 2 * grad_shape[0] * grad_shape[1] * x_shape[1]


# For FlopCounterMode(custom_mapping=...): each operator's count from its arguments' shapes.
GROUPED_MM_FLOPS = {torch.ops.moe.grouped_mm: grouped_mm_flops,
                    torch.ops.moe.grouped_mm_weight_grad: grouped_mm_weight_grad_flops}


# --- torch's grouped GEMM as the CUDA kernel ------------------------------------------------------------------

def grouped_gemm_applies(a: torch.Tensor, b: torch.Tensor, *leading_sizes: int) -> bool:
    """torch's grouped GEMM (``F.grouped_mm``: offsets int32 cumulative; 2-D x 3-D and 2-D x 2-D forms) has a fast
    kernel for these operands: CUDA SM90+ (a loop over ``mm`` on SM80, none on CPU before 2.9), bf16 only, and
    every matrix's leading stride a multiple of 16 bytes (``leading_sizes``: 8 bf16 elements each)."""
    return (a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(a.device) >= (9, 0) and all(n % 8 == 0 for n in leading_sizes))


def grouped_mm_cuda(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The CUDA kernel of ``grouped_mm``: (M, K) x (E, N, K) -> (M, N)."""
    if not grouped_gemm_applies(x, w, x.shape[1], w.shape[1]):
        return grouped_mm_by_expert(x, w, offsets)
    out = F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # (M, K) x (E, K, N), w's strides as they are
    # Rows past offsets[-1] (none in a mixture's dispatch) are left unwritten (seen on an H100, 2.11): zeros, as the
    # loop's.
    rows = torch.ones_like(x[:, 0], dtype=torch.int32).cumsum(0)  # 1..M
    return out.masked_fill((rows > offsets[-1]).unsqueeze(-1), 0)


def weight_grad_cuda(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The CUDA kernel of ``grouped_mm_weight_grad``: (M, N) and (M, K), groups of rows -> (E, N, K)."""
    if not grouped_gemm_applies(grad, x, grad.shape[1], x.shape[1]):
        return weight_grad_by_expert(grad, x, offsets, n_groups)
    out = F.grouped_mm(grad.t(), x, offs=offsets)  # (N, M) x (M, K), groups along M -> (E, N, K)
    # An expert without rows: zero, as the loop's (2.11 on an H100 wrote zeros, but no contract says so; rows past
    # the last offset in the forward are left unwritten there).
    empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0  # (E,)
    return out.masked_fill(empty[:, None, None], 0)


# Registered once, on import: the operator's users get the fast kernel whether or not the engine is imported.
# Without a public grouped GEMM (torch before 2.10) the portable kernel stays CUDA's too.
if hasattr(F, "grouped_mm"):
    grouped_mm.register_kernel("cuda", grouped_mm_cuda)
    grouped_mm_weight_grad.register_kernel("cuda", weight_grad_cuda)
