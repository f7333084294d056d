"""Character spans of a text -> token spans of its ids (the tokens an SFT loss trains on).

A span [start, end) maps to [first, last + 1) over the tokens whose characters overlap it, the rule transformers'
assistant mask applies to offset_mapping: a token straddling either edge is inside the span. The tokenizer gives
no offsets, so they are found one of two ways:

- when decoding each token alone gives texts that join back into the text (byte-level BPE over text whose
  characters no token splits, and no normalizer change), those texts are the tokens' characters: exact;
- otherwise (SentencePiece's "▁" handling, a character split over byte tokens) by encoding prefixes: character c
  is taken as a token edge when encode(text[:c]) is a prefix of encode(text). A pre-tokenizer rule that looks
  ahead (``\\s+(?!\\S)`` in GPT-2-style patterns) can hide an edge inside a run of spaces from this test, which then
  widens the span by the whitespace token before it, never narrows it.
"""

from __future__ import annotations

import bisect

from runtime.tokenizer.json_fields import TokenizerError
from runtime.tokenizer.tokenizer import Tokenizer


def char_spans_to_token_spans(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]], *,
                              ids: list[int] | None = None) -> list[tuple[int, int]]:
    """``ids``: encode(text) without special tokens, when the caller has it already."""
    ids = tokenizer.encode(text) if ids is None else ids
    for start, end in spans:
        if not 0 <= start <= end <= len(text):
            raise TokenizerError(f"character span [{start}, {end}) is not inside the text (length {len(text)})")
    pieces = [tokenizer.decode([token_id]) for token_id in ids]
    if "".join(pieces) == text:
        token_ends, position = [], 0
        for piece in pieces:
            position += len(piece)
            token_ends.append(position)
        token_starts = [0, *token_ends[:-1]]
        # first: the tokens ending at or before start; stop: the tokens starting before end.
        return [(first := bisect.bisect_right(token_ends, start), max(first, bisect.bisect_left(token_starts, end)))
                for start, end in spans]
    return _spans_from_prefixes(tokenizer, text, spans, ids)


def _spans_from_prefixes(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]],
                         ids: list[int]) -> list[tuple[int, int]]:
    known: dict[int, int | None] = {0: 0, len(text): len(ids)}

    def tokens_before(edge: int) -> int | None:
        """How many tokens lie before character ``edge`` when it is a token edge; else None."""
        if edge not in known:
            prefix = tokenizer.encode(text[:edge])
            known[edge] = len(prefix) if ids[: len(prefix)] == prefix else None
        return known[edge]

    token_spans = []
    for start, end in spans:
        first = next(count for edge in range(start, -1, -1) if (count := tokens_before(edge)) is not None)
        stop = next(count for edge in range(end, len(text) + 1) if (count := tokens_before(edge)) is not None)
        token_spans.append((first, max(first, stop)))
    return token_spans
