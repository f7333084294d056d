"""A corpus as the engine samples it: memory-mapped token spans cut into windows, and where documents begin.

**Windows.** Window w of a span is T input tokens and the next token as the last target: tokens
[w*T, w*T + T + 1). Consecutive windows share one token (the last target of one is the first input of
the next), so every token of a span but the last few is an input once and a target once per epoch, as
in nanoGPT's and llm.c's loaders. A span of n tokens holds (n - 1) // T windows; no window crosses two
spans (files).

**Documents.** ``positions`` gives each input token's position within its document: 0 on a document's
first token. A document ends with its end-of-document token (Megatron's convention: positions restart
on the token *after* it), or where the Megatron index says; a file's first token starts a document.
Here positions count from the document's true start, also for a window that starts mid-document;
``restart_at_window`` turns them into Megatron's window-relative ``reset_position_ids`` (what batches
give by default: every position < T). A corpus without document information treats each window as one
document.

**Columns.** A context-parallel rank holds 2 chunks of T/(2·cp) input columns of every window
(compiler/parallelize/context_parallel.py), so ``columns`` reads a window's columns [lo, hi) and the one token
after (the last target), and ``column_documents`` their window-relative positions and document ids from the
document index alone: the rank copies T/cp + 2 tokens of each row instead of T + 1.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field
from typing import Protocol

import torch


class DataError(ValueError):
    """Unusable --data or --val-data; the message names the flag, the file and what is valid."""


class Int64Array:
    """Little-endian int64 values in a buffer (an ``mmap`` or bytes) read one at a time: no copy of the array,
    any byte offset (Megatron's .idx puts its int64 arrays at offsets no tensor view could take)."""

    def __init__(self, buffer, *, offset: int, count: int):
        self.buffer, self.offset, self.count = buffer, offset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return struct.unpack_from("<q", self.buffer, self.offset + 8 * i)[0]


class DocumentIndex(Protocol):
    def starts_around(self, lo: int, hi: int) -> list[int]:
        """The start of the document holding token ``lo``, then every document start in (lo, hi), ascending."""


@dataclass(frozen=True)
class EodDocuments:
    """Documents ended by an end-of-document token, from the sorted token offsets where it occurs."""

    eods: Int64Array

    def starts_around(self, lo: int, hi: int) -> list[int]:
        i = bisect.bisect_left(self.eods, lo)  # eods before lo: the last one ends the document before
        starts = [self.eods[i - 1] + 1 if i else 0]
        while i < len(self.eods) and self.eods[i] + 1 < hi:
            if self.eods[i] + 1 > lo:
                starts.append(self.eods[i] + 1)
            i += 1
        return starts


@dataclass(frozen=True)
class IndexedDocuments:
    """Megatron's document index: sequence byte pointers, and the sequence that begins each document
    (``document_indices``: 0, then one past each document's last sequence)."""

    pointers: Int64Array  # (S,) byte offset of each sequence in the .bin
    document_indices: Int64Array  # (D + 1,)
    itemsize: int

    def _start(self, d: int) -> int:
        return self.pointers[self.document_indices[d]] // self.itemsize

    def starts_around(self, lo: int, hi: int) -> list[int]:
        sequence = bisect.bisect_right(self.pointers, lo * self.itemsize) - 1
        d = bisect.bisect_right(self.document_indices, sequence) - 1
        starts = [self._start(d)]
        d += 1
        while d < len(self.document_indices) - 1 and self.document_indices[d] < len(self.pointers):
            start = self._start(d)
            if start >= hi:
                break
            if start > starts[-1]:
                starts.append(start)
            d += 1
        return starts


def positions_from_starts(lo: int, length: int, starts: list[int]) -> torch.Tensor:
    """Positions of tokens [lo, lo + length) within their documents, given ``starts_around(lo, lo + length)``."""
    offsets = torch.arange(lo, lo + length)
    boundaries = torch.tensor(starts, dtype=torch.int64)
    return offsets - boundaries[torch.searchsorted(boundaries, offsets, right=True) - 1]


def window_documents(start: int, lo: int, hi: int, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids of input columns [lo, hi) of the window whose first token is file offset
    ``start``, given ``starts_around(start, start + hi)``: exactly ``restart_at_window`` of the window's positions
    and ``document_ids`` of those (runtime/engine/data/inputs.py), columns [lo, hi) of them, without the columns
    before ``lo``. Both treat the window's first token as a document start, so a column's id is the number of
    document starts in [start, column]: the index counts the ones before ``lo``, no token needs reading."""
    offsets = torch.arange(start + lo, start + hi)  # (hi - lo,) file offsets of the columns
    boundaries = torch.tensor([start, *starts[1:]], dtype=torch.int64)  # (D,) ascending: the window's documents
    ids = torch.searchsorted(boundaries, offsets, right=True)  # (hi - lo,) 1 in the window's first document
    return offsets - boundaries[ids - 1], ids


def positions_after_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(B, T) tokens -> positions within documents that restart after each ``eod`` token (each row's first
    token starts a document): what a row drawn on its own (synthetic data) has."""
    T = tokens.shape[-1]
    index = torch.arange(T).expand_as(tokens)
    restart = torch.zeros_like(tokens, dtype=torch.bool)
    restart[..., 1:] = tokens[..., :-1] == eod
    start = torch.where(restart, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start


def restart_at_window(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) document positions -> Megatron's ``reset_position_ids``: the document a window starts in is
    counted from the window's first token (0), the others as they are."""
    first_document = (positions == 0).long().cumsum(dim=-1) == 0  # before the window's first restart
    return torch.where(first_document, positions - positions[..., :1], positions)


@dataclass(frozen=True)
class TokenSpan:
    """Tokens [begin, end) of one file's memory-mapped tokens."""

    name: str  # the file, for messages
    tokens: torch.Tensor  # (n,) the whole file's tokens, any integer dtype, memory-mapped
    begin: int
    end: int
    documents: DocumentIndex | None = None  # offsets in ``tokens``

    def __len__(self) -> int:
        return self.end - self.begin

    def windows(self, seq_len: int) -> int:
        return max(0, (len(self) - 1) // seq_len)

    def window(self, w: int, seq_len: int) -> torch.Tensor:
        return self.columns(w, seq_len, 0, seq_len)  # (T + 1,)

    def columns(self, w: int, seq_len: int, lo: int, hi: int) -> torch.Tensor:
        """Input columns [lo, hi) of window ``w`` and the token after them (the last column's target):
        (hi - lo + 1,), copying only these tokens (a context-parallel rank reads its chunks, 1/cp of the row)."""
        start = self.begin + w * seq_len
        return self.tokens[start + lo: start + hi + 1].long()

    def column_documents(self, w: int, seq_len: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window-relative positions and document ids of input columns [lo, hi) of window ``w``: (hi - lo,) each."""
        start = self.begin + w * seq_len
        starts = [start] if self.documents is None else self.documents.starts_around(start, start + hi)
        return window_documents(start, lo, hi, starts)

    def positions(self, w: int, seq_len: int) -> torch.Tensor:
        if self.documents is None:
            return torch.arange(seq_len)
        start = self.begin + w * seq_len
        return positions_from_starts(start, seq_len, self.documents.starts_around(start, start + seq_len))


@dataclass(frozen=True)
class Corpus:
    """Spans read as one sequence of windows: global window g is window g - first[s] of span s."""

    spans: tuple[TokenSpan, ...]
    seq_len: int
    first: tuple[int, ...] = field(init=False)  # (S + 1,) cumulative window counts

    def __post_init__(self) -> None:
        counts = [0]
        for span in self.spans:
            counts.append(counts[-1] + span.windows(self.seq_len))
        object.__setattr__(self, "first", tuple(counts))

    @property
    def windows(self) -> int:
        return self.first[-1]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.spans)

    def _locate(self, g: int) -> tuple[TokenSpan, int]:
        s = bisect.bisect_right(self.first, g) - 1
        return self.spans[s], g - self.first[s]

    def window(self, g: int) -> torch.Tensor:
        span, w = self._locate(g)
        return span.window(w, self.seq_len)

    def positions(self, g: int) -> torch.Tensor:
        span, w = self._locate(g)
        return span.positions(w, self.seq_len)

    def columns(self, g: int, lo: int, hi: int) -> torch.Tensor:
        span, w = self._locate(g)
        return span.columns(w, self.seq_len, lo, hi)

    def column_documents(self, g: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        span, w = self._locate(g)
        return span.column_documents(w, self.seq_len, lo, hi)


def hold_out_tail(spans: list[TokenSpan], *, fraction: float, need: int) -> tuple[list[TokenSpan], list[TokenSpan]]:
    """Split the spans' tokens into the first 1 - ``fraction`` and the last ``fraction`` (at least ``need``
    tokens), cutting the span the boundary falls in."""
    total = sum(len(s) for s in spans)
    n_val = max(need, int(total * fraction))
    cut = total - n_val
    train, val, seen = [], [], 0
    for span in spans:
        if seen + len(span) <= cut:
            train.append(span)
        elif seen >= cut:
            val.append(span)
        else:
            middle = span.begin + (cut - seen)
            train.append(TokenSpan(span.name, span.tokens, span.begin, middle, span.documents))
            val.append(TokenSpan(span.name, span.tokens, middle, span.end, span.documents))
        seen += len(span)
    return train, val
