"""Causal attention of packed documents without a (B, 1, T, T) mask: the core every family's attention calls once
its q, k and v are projected and rotated.

``CausalAttention(q, k, v, documents)``: q (B, H, T, hd), k and v (B, Hkv, T, hd) (grouped heads shared, as
``enable_gqa``), ``documents`` (B, T) int64 document ids, non-decreasing along each row, or None for one
document. Each token attends causally within its own document (Megatron's reset_attention_mask), computed as
one causal ``scaled_dot_product_attention`` call per run of one document in a row, so the flash kernels run
and nothing of size T x T is built; without documents, one causal call. The document ids come with the batch
(the data loader counts documents over the whole window), never from positions: a window cut into chunks
(context parallelism) would not know where its documents began.

Those calls take a new shape at nearly every step (documents' lengths vary), so they run on the kernels that take
any length at no host cost (``any_length_kernels``): PyTorch prefers cuDNN's attention on Hopper GPUs, and cuDNN
builds an execution graph for every new shape (tens to hundreds of milliseconds on the host; sglang measured
~400 ms per build, pytorch/pytorch#191576 42 ms). Measured on an H200 before this (torch 2.11, a 1B Llama at
T 8192, ~6 documents per sequence): the step took 0.96 s against 0.22 s without the mask, its forward and backward
each ~6x longer with no idle time, while the same attention calls with lengths already seen took 2.4 ms against
2.5 ms for one causal call.

The loop over documents depends on the data, which a traced graph cannot keep, so this is an ``EagerModule``:
the tracer sees ``trace_forward`` (one causal call) and the engine runs the real module in its stages, or
replaces it with its context-parallel version (compiler/parallelize/context_parallel.py), which takes the same
arguments for the rank's slice of each sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.spec import EagerModule

# The kernels whose cost does not depend on having seen a shape before (all but cuDNN's: see the module docstring).
# Flash covers fp16 / bf16, the memory-efficient kernel fp32 too; the math kernel is the last resort.
_ANY_LENGTH_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def any_length_kernels():
    """Context in which ``scaled_dot_product_attention`` calls of ever-new lengths pick no cuDNN kernel. The
    backward runs the kernel its forward chose, so only forwards (and their recomputation) need it."""
    return sdpa_kernel(_ANY_LENGTH_BACKENDS)


class CausalAttention(EagerModule):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rows = []
        with any_length_kernels():
            for b in range(q.shape[0]):
                runs = [F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                       v[b:b + 1, :, lo:hi], is_causal=True, enable_gqa=True)
                        for lo, hi in document_runs(documents[b])]
                rows.append(torch.cat(runs, dim=2))
        return torch.cat(rows, dim=0)  # (B, H, T, hd)

    def trace_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def document_runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) of each run of equal values in a 1-D tensor of document ids."""
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten().add(1).tolist()
    edges = [0, *change, ids.numel()]
    return list(zip(edges[:-1], edges[1:]))
