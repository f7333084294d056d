"""Next-token cross-entropy that never holds fp32 logits: computed over chunks of rows, on the whole
vocabulary or on this rank's vocabulary shard (Megatron-LM's vocab_parallel_cross_entropy, Shoeybi et al.
2019, sec. 3).

``F.cross_entropy(logits.float(), targets)`` keeps an fp32 copy of the [N, V] logits for the log-softmax
and its backward holds two more fp32 tensors of that size (the log-softmax's output gradient and its input
gradient); at GPT-2's 50,257-word vocabulary those dominate the last stage's peak. Here the forward upcasts
one chunk of rows at a time and keeps, per row, only the log-sum-exp and the target's logit (fp32 [N]); it
saves the logits as they are (the last stage keeps them anyway, as its output, until its backward). The
backward recomputes each chunk's softmax (one fused pass; from the saved log-sum-exp where the vocabulary is
sharded) and writes the gradient straight into a tensor of the logits' dtype:

    loss_i = lse_i - x_i[y_i],   d loss_i / d x_ij = softmax(x_i)_j - [j == y_i] = exp(x_ij - lse_i) - [j == y_i]

Vocabulary-parallel (``group`` given): rank r holds columns [vocab_start, vocab_start + V_r) of the logits.
Each rank computes its shard's log-sum-exp and the target logit where the target falls in its columns
(zero elsewhere); two all-reduces over the group then give every rank the whole vocabulary's values:
MAX of the local log-sum-exps m, then SUM of [exp(lse_r - m), target logit], so lse = m + log(sum). The
gradient of a shard needs no communication: its softmax uses the global lse. Written with explicit
collectives instead of DTensor's ``loss_parallel`` (whose log-softmax holds fp32 [N, V/mp] tensors as
F.cross_entropy does).

Targets equal to ``ignore_index`` add nothing and are not counted in the mean (F.cross_entropy's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from compiler.torch_compat import compute_local_shape_and_global_offset

IGNORE_INDEX = -100  # F.cross_entropy's default
# What the loss saves per token besides the logits: the fp32 log-sum-exp, the int64 column of the target
# and two bool masks (the target is in this shard; it is not ignored).
SAVED_BYTES_PER_TOKEN = 4 + 8 + 1 + 1
# fp32 bytes of one chunk of rows: the loss's working memory is two of these. The CPU's fit its caches: a chunk's
# fp32 copy is then never written out to memory and read back (and a node's memory is shared by every rank); on an
# accelerator larger chunks run faster, with diminishing returns past a few hundred MiB (tests/gpu/gpu_loss_chunks.py
# measures it; runtime/README.md records the figures of both).
CPU_CHUNK_BYTES = 2 * 2**20
ACCELERATOR_CHUNK_BYTES = 256 * 2**20


def loss_chunk_bytes(device_type: str) -> int:
    """The chunk size on a device of this type ("cpu", or "cuda" / "gpu" and any other accelerator)."""
    return CPU_CHUNK_BYTES if device_type == "cpu" else ACCELERATOR_CHUNK_BYTES


def chunk_rows(width: int, *, chunk_bytes: int = CPU_CHUNK_BYTES) -> int:
    """Rows of [*, width] logits upcast at once: ``chunk_bytes`` of fp32, at least one row."""
    return max(1, chunk_bytes // (4 * max(1, width)))


@dataclass(frozen=True)
class VocabularyShard:
    """The columns of vocabulary-parallel logits this rank holds: [start, start + V_r), over ``group``."""
    group: dist.ProcessGroup
    start: int


def vocabulary_shard(vocab_mesh: DeviceMesh, vocab_size: int) -> VocabularyShard:
    """This rank's shard of the head's V rows as DTensor's Shard(0) lays them out (V need not divide by mp:
    GPT-2's 50,257), i.e. the columns of the logits it computes."""
    _, (start,) = compute_local_shape_and_global_offset((vocab_size,), vocab_mesh, [Shard(0)])
    return VocabularyShard(vocab_mesh.get_group(), start)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, shard: VocabularyShard | None = None,
                        reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (b, t, V) logits (or this rank's (b, t, V/mp) shard) against (b, t) targets, fp32."""
    return chunked_cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"),
                                 reduction=reduction, group=shard.group if shard else None,
                                 vocab_start=shard.start if shard else 0)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean",
                          ignore_index: int = IGNORE_INDEX, group: dist.ProcessGroup | None = None,
                          vocab_start: int = 0, rows_per_chunk: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` [N, V_local] (any float dtype) against ``targets`` [N] (global token ids),
    in fp32; "mean" over the targets that are not ``ignore_index``, or their "sum". With ``group`` the logits
    are this rank's columns starting at ``vocab_start`` and every rank of the group returns the same loss."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    rows = rows_per_chunk or chunk_rows(logits.shape[-1], chunk_bytes=loss_chunk_bytes(logits.device.type))
    return _ChunkedCrossEntropy.apply(logits, targets, group, vocab_start, rows, ignore_index, reduction == "mean")


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, rows, ignore_index, mean):
        width = logits.shape[1]
        valid = targets != ignore_index  # [N]
        local = targets - vocab_start
        here = valid & (local >= 0) & (local < width)  # [N]: the target is one of this rank's columns
        local = local.masked_fill(~here, 0)
        lse, target_logit = _row_statistics(logits, local, rows)
        target_logit = target_logit.masked_fill(~here, 0.0)
        if group is not None:
            lse, target_logit = _combine_over_vocabulary_shards(lse, target_logit, group)
        losses = (lse - target_logit).masked_fill(~valid, 0.0)  # [N] fp32
        count = valid.sum()
        ctx.save_for_backward(logits, lse, local, here, valid, count)
        ctx.rows, ctx.mean, ctx.group = rows, mean, group
        return losses.sum() / count if mean else losses.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, here, valid, count = ctx.saved_tensors
        weight = valid.to(lse.dtype) * (grad_loss / count if ctx.mean else grad_loss)  # [N]: d loss / d loss_i
        grad = torch.empty_like(logits)
        local_softmax = ctx.group is None  # the whole vocabulary is here: softmax needs no outside statistic
        for start in range(0, logits.shape[0], ctx.rows):
            rows = slice(start, start + ctx.rows)
            if local_softmax:  # [c, V] fp32, one fused pass over the logits chunk
                p = torch.softmax(logits[rows], dim=1, dtype=lse.dtype)
            else:  # with the whole vocabulary's log-sum-exp; bf16 - fp32 promotes to fp32 in the subtraction
                p = torch.sub(logits[rows], lse[rows, None]).exp_()
            p.scatter_add_(1, local[rows, None], -here[rows, None].to(p.dtype))  # minus the one-hot target
            _scale_into(p, weight[rows, None], grad[rows])
        return grad, None, None, None, None, None, None


def _row_statistics(logits: torch.Tensor, local: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits``, fp32: log-sum-exp over its columns and the logit at column ``local``.

    One fused log-softmax pass per chunk (input in the logits' dtype, output fp32) and a max over the chunk:
    lse = x_max - log_softmax(x)_max, where log_softmax at the row's largest logit lies in [-log V, 0], so the
    subtraction loses nothing. (``torch.logsumexp`` on upcast logits makes ~5 passes over an fp32 copy: on an
    H200 the loss of 8192 x 50,257 bf16 logits took 2x F.cross_entropy's time that way.)"""
    n, dtype = logits.shape[0], _compute_dtype(logits.dtype)
    lse = torch.empty(n, dtype=dtype, device=logits.device)
    target_logit = torch.empty(n, dtype=dtype, device=logits.device)
    for start in range(0, n, rows):
        chunk = logits[start:start + rows]  # [c, V_local], the logits' dtype
        largest, column = chunk.max(dim=1)  # [c]
        log_probs = torch.log_softmax(chunk, dim=1, dtype=dtype)  # [c, V_local] fp32
        lse[start:start + rows] = largest.to(dtype) - log_probs.gather(1, column[:, None]).squeeze(1)
        target_logit[start:start + rows] = chunk.gather(1, local[start:start + rows, None]).squeeze(1).to(dtype)
    return lse, target_logit


def _scale_into(p: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = p * weight, cast to ``out``'s dtype: [c, V] fp32 times [c, 1]. On an accelerator one kernel casts as
    it writes (6 bytes per element for bf16 instead of 14); the CPU's mixed-dtype ``out=`` kernel is not
    vectorised (slower than multiplying in place and copying), so it copies."""
    if out.device.type == "cpu" and out.dtype != p.dtype:
        out.copy_(p.mul_(weight))
    else:
        torch.mul(p, weight, out=out)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower logits (bf16, fp16), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _combine_over_vocabulary_shards(lse: torch.Tensor, target_logit: torch.Tensor,
                                    group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's log-sum-exp and target logit from every shard's (module docstring)."""
    largest = lse.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(lse - largest).exp(), target_logit])  # [2, N]
    dist.all_reduce(sums, group=group)
    return largest + sums[0].log(), sums[1]
