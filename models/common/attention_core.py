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

**Sliding windows and sinks** (gpt-oss): ``CausalAttention(window=W)`` lets query i see keys j with i - W < j <= i
within its document; ``SinkAttention`` also takes each query's sink logit, ``sinks`` (B, H, T), which joins its
softmax's denominator once (models/common/attention.py ``AttentionSinks``). Both run on the banded operator of
banded_attention.py: one call per run of one document, each query chunk meeting only the keys it sees
(``visible_keys``), no T x T tensor.

The loop over documents depends on the data, which a traced graph cannot keep, so this is an ``EagerModule``:
the tracer sees ``trace_forward`` (one causal call) and the engine runs the real module in its stages, or
replaces it with its context-parallel version (compiler/parallelize/context_parallel.py), which takes the same
arguments for the rank's slice of each sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.common.banded_attention import banded_attention
from models.spec import EagerModule

# The kernels whose cost does not depend on having seen a shape before (all but cuDNN's: see the module docstring).
# Flash covers fp16 / bf16, the memory-efficient kernel fp32 too; the math kernel is the last resort.
_ANY_LENGTH_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def any_length_kernels():
    """Context in which ``scaled_dot_product_attention`` calls of ever-new lengths pick no cuDNN kernel. The
    backward runs the kernel its forward chose, so only forwards (and their recomputation) need it."""
    return sdpa_kernel(_ANY_LENGTH_BACKENDS)


class CausalAttention(EagerModule):
    """Causal attention within documents; ``window``: a sliding window of that many keys (None: every earlier key)."""

    def __init__(self, *, window: int | None = None):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(q, k, v, None, documents)

    def trace_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.cached(q, k, v, q_offset=0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               documents: torch.Tensor | None) -> torch.Tensor:
        """q (B, H, T, hd), k and v (B, Hkv, T, hd), sinks (B, H, T) or None, documents (B, T) or None -> (B, H, T,
        hd): one call for one document, else one per run of a document in each row."""
        if documents is None:
            return self.cached(q, k, v, q_offset=0, sinks=sinks)
        rows = []
        with any_length_kernels():
            for b in range(q.shape[0]):
                rows.append(torch.cat([self.cached(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi],
                                                   q_offset=0, sinks=None if sinks is None else sinks[b:b + 1, :, lo:hi])
                                       for lo, hi in document_runs(documents[b])], dim=2))
        return torch.cat(rows, dim=0)

    def cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, Lq, hd) at the last Lq of the Lk = q_offset + Lq key positions of one document (a KV cache's
        new tokens, a document's run); sinks (B, H, Lq) or None."""
        if self.window or sinks is not None:
            return banded_attention(q, k, v, sinks=sinks, q_offset=q_offset, window=self.window)[0]
        if q_offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if q.shape[2] == 1:  # one new token sees every key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=q_offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class SinkAttention(CausalAttention):
    """``CausalAttention`` whose queries each bring a sink logit: ``forward(q, k, v, sinks, documents=None)``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(q, k, v, sinks, documents)

    def trace_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.cached(q, k, v, q_offset=0, sinks=sinks)


def document_runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) of each run of equal values in a 1-D tensor of document ids."""
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten().add(1).tolist()
    edges = [0, *change, ids.numel()]
    return list(zip(edges[:-1], edges[1:]))
