"""What the model takes for a batch of windows: its inputs and next-token targets, with positions and document
ids where packed documents or context parallelism need them, cut to a context-parallel rank's chunks.

- plain sequences: tokens (B, T);
- packed documents (``--document-mask``): (tokens, positions, documents): each token's position within its
  document (RoPE, learned positions) and its document's id, counted over the whole window (models/common/
  attention_core.py): a chunk of a window cannot tell where its documents began;
- a context-parallel rank (``--cp``): the same, or (tokens, positions) with global positions, cut to its two
  load-balanced chunks (compiler/parallelize/context_parallel.py), targets alike. From token files a rank reads
  only those chunks' columns (``chunked_model_batch``): 1/cp of each row, the same tensors as cutting whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from compiler.parallelize.context_parallel import local_chunks
from compiler.parallelize.cross_entropy import IGNORE_INDEX
from runtime.engine.data.batches import CorpusBatches, SyntheticBatches
from runtime.engine.data.future_tokens import future_columns, mask_after_end_of_document, stack_targets

Inputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ContextSlice:
    rank: int  # this rank's index in its context-parallel group
    size: int  # cp


def model_batch(rows: torch.Tensor, positions: torch.Tensor | None, *, context: ContextSlice | None = None,
                mtp_depth: int = 0) -> tuple[Inputs, torch.Tensor]:
    """(B, T+1) token rows and, for packed documents, their (B, T) positions within documents -> (inputs, targets);
    with ``mtp_depth`` D > 0 the targets are the (B, T, 2D + 1 + E) stack of runtime/engine/data/future_tokens.py."""
    # Copies with a fresh tensor's strides: a stage checks its inputs' strides against the traced example's, and
    # .contiguous() keeps a (1, T) slice's row stride T + 1 (a size-1 dimension's stride does not count).
    tokens, targets = (rows[:, cols].clone(memory_format=torch.contiguous_format)
                       for cols in (slice(None, -1), slice(1, None)))
    extras: list[torch.Tensor] = []
    if positions is not None:
        extras = [positions, document_ids(positions)]
    elif context is not None and context.size > 1:
        extras = [torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()]
    if mtp_depth:
        labels, future = future_columns(tokens, targets, depth=mtp_depth, length=tokens.shape[1],
                                        documents=extras[1] if positions is not None else None)
        targets = stack_targets(labels, future, extras)
    if context is not None and context.size > 1:
        tokens, targets, *extras = (local_chunks(t, rank=context.rank, cp=context.size) for t in (tokens, targets, *extras))
    return (tokens, *extras) if extras else tokens, targets


class ColumnReader(Protocol):
    """Rows read a range of input columns at a time (runtime/engine/data/batches.py ``WindowColumns``)."""

    def tokens(self, lo: int, hi: int) -> torch.Tensor: ...  # (B, hi - lo + 1): columns [lo, hi] of the rows

    def documents(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # (B, hi - lo) positions, ids


def chunk_columns(seq_len: int, context: ContextSlice) -> list[tuple[int, int]]:
    """The input columns [lo, hi) of this rank's two chunks, in the order ``local_chunks`` concatenates them."""
    cp = context.size
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2·cp = {2 * cp} equal chunks")
    length = seq_len // (2 * cp)
    return [(c * length, (c + 1) * length) for c in (context.rank, 2 * cp - 1 - context.rank)]


def chunked_model_batch(columns: ColumnReader, *, seq_len: int, document_mask: bool, context: ContextSlice,
                        mtp_depth: int = 0) -> tuple[Inputs, torch.Tensor]:
    """``model_batch(rows, positions, context=context, mtp_depth=...)`` of the whole rows, reading only this rank's two
    chunks: chunk [lo, hi) takes row columns [lo, hi + 1) (its targets are the next tokens), so the rank copies
    T/cp + 2 tokens of each row, not T + 1; with D MTP depths, D columns more where the window has them (the depths'
    shifted tokens, runtime/engine/data/future_tokens.py). Document ids come counted over the whole window
    (``columns.documents``)."""
    pieces = []
    for lo, hi in chunk_columns(seq_len, context):
        end = min(hi + mtp_depth, seq_len)  # past the last input column a depth needs (t_{hi-1+D}), or the window's end
        rows = columns.tokens(lo, end)  # (B, end - lo + 1): the inputs, then the last target
        if document_mask:
            positions, ids = columns.documents(lo, end)  # (B, end - lo) positions within documents, document ids
            extras = [positions[:, :hi - lo], ids[:, :hi - lo]]
        else:
            ids, extras = None, [torch.arange(lo, hi).expand(rows.shape[0], -1)]  # (B, L) global positions
        tokens, targets = rows[:, :-1], rows[:, 1:]
        if mtp_depth:
            labels, future = future_columns(tokens, targets, depth=mtp_depth, length=hi - lo, documents=ids)
            targets = stack_targets(labels, future, extras)
        pieces.append((tokens[:, :hi - lo], targets[:, :hi - lo], *extras))
    tokens, targets, *extras = (torch.cat(parts, dim=1) for parts in zip(*pieces))  # (B, T/cp) each
    return (tokens, *extras), targets


def rank_batch(source: CorpusBatches | SyntheticBatches, step: int, rows: tuple[int, int], *, document_mask: bool,
               context: ContextSlice | None, mtp_depth: int = 0) -> tuple[Inputs, torch.Tensor]:
    """Rows ``rows`` of global batch ``step`` of ``source`` as this rank's (inputs, targets). A context-parallel
    rank reads only its chunks' columns where the source reads columns (token files); other sources (synthetic
    rows, drawn whole from a seed) give whole rows, cut here. Chat data's untrained targets are ``IGNORE_INDEX``."""
    if context is not None and context.size > 1 and hasattr(source, "columns"):
        inputs, targets = chunked_model_batch(source.columns(step, *rows), seq_len=source.seq_len,
                                              document_mask=document_mask, context=context, mtp_depth=mtp_depth)
    else:
        positions = source.positions(step, *rows) if document_mask else None
        inputs, targets = model_batch(source.rows(step, *rows), positions, context=context, mtp_depth=mtp_depth)
    return inputs, with_loss_mask(targets, source.loss_mask(step, *rows), context=context)


def with_loss_mask(targets: torch.Tensor, mask: torch.Tensor | None, *, context: ContextSlice | None) -> torch.Tensor:
    """``targets`` with ``IGNORE_INDEX`` where the (B, T) ``mask`` of whole rows is False (chat data: the prompt's
    tokens), cut as the targets are to a context-parallel rank's chunks; ``targets`` as they are without a mask.
    (Chat data trains without MTP depths, runtime/config.py: the targets are then (B, T).)"""
    if mask is None:
        return targets
    if context is not None and context.size > 1:
        mask = local_chunks(mask, rank=context.rank, cp=context.size)
    return targets.masked_fill(~mask, IGNORE_INDEX)


def without_loss_across_documents(inputs: Inputs, targets: torch.Tensor, eod: int, *, mtp_depth: int = 0) -> torch.Tensor:
    """``targets`` with ``IGNORE_INDEX`` wherever the input token is ``eod``: the token after an end of document
    is the next document's first, not predicted from the previous one (Megatron-LM's eod_mask_loss); likewise every
    MTP depth's label (``mtp_depth``). Per position, so a context-parallel rank's chunks get what cutting the masked
    whole rows gives."""
    tokens = inputs[0] if isinstance(inputs, tuple) else inputs  # (B, T) or (B, T/cp)
    if mtp_depth:
        return mask_after_end_of_document(targets, tokens, eod, mtp_depth)
    return targets.masked_fill(tokens == eod, IGNORE_INDEX)


def model_input_count(*, document_mask: bool, cp: int) -> int:
    """How many tensors the model takes: tokens, and positions and document ids as above."""
    return 3 if document_mask else 2 if cp > 1 else 1


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) positions within documents (0 starts one) -> (B, T) document ids, the running count of starts (a
    document begun before the window restarts at its first token, runtime/engine/data/corpus.py)."""
    return (positions == 0).long().cumsum(-1)
