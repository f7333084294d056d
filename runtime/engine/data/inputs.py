"""What the model takes for a batch of windows: its inputs and next-token targets, with positions and document
ids where packed documents or context parallelism need them, cut to a context-parallel rank's chunks.

- plain sequences: tokens (B, T);
- packed documents (``--document-mask``): (tokens, positions, documents): each token's position within its
  document (RoPE, learned positions) and its document's id, counted over the whole window (models/common/
  attention_core.py): a chunk of a window cannot tell where its documents began;
- a context-parallel rank (``--cp``): the same, or (tokens, positions) with global positions, cut to its two
  load-balanced chunks (compiler/parallelize/context_parallel.py), targets alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.parallelize.context_parallel import local_chunks

Inputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ContextSlice:
    rank: int  # this rank's index in its context-parallel group
    size: int  # cp


def model_batch(rows: torch.Tensor, positions: torch.Tensor | None, *,
                context: ContextSlice | None = None) -> tuple[Inputs, torch.Tensor]:
    """(B, T+1) token rows and, for packed documents, their (B, T) positions within documents -> (inputs, targets)."""
    tokens, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    extras: list[torch.Tensor] = []
    if positions is not None:
        extras = [positions, document_ids(positions)]
    elif context is not None and context.size > 1:
        extras = [torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()]
    if context is not None and context.size > 1:
        tokens, targets, *extras = (local_chunks(t, rank=context.rank, cp=context.size) for t in (tokens, targets, *extras))
    return (tokens, *extras) if extras else tokens, targets


def model_input_count(*, document_mask: bool, cp: int) -> int:
    """How many tensors the model takes: tokens, and positions and document ids as above."""
    return 3 if document_mask else 2 if cp > 1 else 1


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) positions within documents (0 starts one) -> (B, T) document ids, the running count of starts (a
    document begun before the window restarts at its first token, runtime/engine/data/corpus.py)."""
    return (positions == 0).long().cumsum(-1)
