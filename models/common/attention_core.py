"""Causal attention of packed documents without a (B, 1, T, T) mask: the core every family's attention calls once
its q, k and v are projected and rotated.

``CausalAttention(q, k, v, documents)``: q (B, H, T, hd), k and v (B, Hkv, T, hd) (grouped heads shared, as
``enable_gqa``), ``documents`` (B, T) int64 document ids, non-decreasing along each row, or None for one
document. Each token attends causally within its own document (Megatron's reset_attention_mask), computed as
one causal ``scaled_dot_product_attention`` call per run of one document in a row, so the flash kernels run
and nothing of size T x T is built; without documents, one causal call. The document ids come with the batch
(the data loader counts documents over the whole window), never from positions: a window cut into chunks
(context parallelism) would not know where its documents began.

The loop over documents depends on the data, which a traced graph cannot keep, so this is an ``EagerModule``:
the tracer sees ``trace_forward`` (one causal call) and the engine runs the real module in its stages, or
replaces it with its context-parallel version (compiler/parallelize/context_parallel.py), which takes the same
arguments for the rank's slice of each sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.spec import EagerModule


class CausalAttention(EagerModule):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rows = []
        for b in range(q.shape[0]):
            runs = [F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi],
                                                   is_causal=True, enable_gqa=True)
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
