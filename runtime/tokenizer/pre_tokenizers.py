r"""tokenizer.json pre-tokenizers: a piece of text -> the words BPE sees.

A piece is ``(text, where)``: ``START`` begins the original text (Metaspace's "first" scheme prepends
only there), ``MIDDLE`` begins a piece after an added token or a split, ``CONTINUED`` continues a piece
cut off before it (a long document tokenized in segments, segments.py): no prefix goes in front of it,
and a split there makes its first part an ordinary piece. Supported, with tokenizers' semantics:

    ByteLevel   a space in front (add_prefix_space, unless the piece starts with one), GPT-2's split
                regex (use_regex), then each byte as one alphabet character (byte_level.py)
    Split       an Oniguruma regex or a string; behavior Isolated, Removed, MergedWithPrevious,
                MergedWithNext or Contiguous; invert (tokenizers' ``Invert``: the matches and the text
                between them swap roles before the behavior applies, so gpt-oss's ``Removed`` + invert
                keeps the matches as words and drops what lies between them)
    Metaspace   spaces -> "▁", "▁" in front (prepend_scheme always / first / never), split before "▁"
    Digits      numbers (\p{N}) apart (individual_digits) or in runs
    Sequence    each in order, every step on every piece the previous made

Empty pieces are dropped, as tokenizers does. A ByteLevel that comes last leaves its character mapping to
the word cache (``byte_level_words``), so a word seen before is never mapped again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from runtime.tokenizer import byte_level
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.normalizers import compile_replace_pattern
from runtime.tokenizer.regex import compile_pattern, find_spans

START, MIDDLE, CONTINUED = 2, 1, 0
Piece = tuple[str, int]  # (text, where: START, MIDDLE or CONTINUED)
Step = Callable[[list[Piece]], list[Piece]]
SUPPORTED = ("ByteLevel", "Split", "Sequence", "Metaspace", "Digits")
BEHAVIORS = ("Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # byte_level.rs


@lru_cache(maxsize=1)
def gpt2_regex() -> re.Pattern:
    return compile_pattern(GPT2_PATTERN)


@dataclass(frozen=True)
class PreTokenizer:
    steps: tuple[Step, ...]
    byte_level_words: bool  # the last step is ByteLevel: words still need byte_level.to_byte_chars
    words_regex: re.Pattern | None  # the whole pre-tokenizer is one regex split whose matches are the words

    def words(self, text: str, where: int) -> list[str]:
        pieces = [(text, where)]
        for step in self.steps:
            pieces = step(pieces)
        return [t for t, _ in pieces]


def build_pre_tokenizer(node: Node) -> PreTokenizer:
    if node.value is None:
        return PreTokenizer((), False, None)
    flat = _flatten(node)
    last_byte_level = bool(flat) and flat[-1].value.get("type") == "ByteLevel"
    steps = tuple(_step(n, defer_bytes=last_byte_level and i == len(flat) - 1) for i, n in enumerate(flat))
    return PreTokenizer(steps, last_byte_level, _words_regex(flat))


def _flatten(node: Node) -> list[Node]:
    if node.type_of(SUPPORTED) == "Sequence":
        return [leaf for child in node.items("pretokenizers") for leaf in _flatten(child)]
    return [node]


def _words_regex(flat: list[Node]) -> re.Pattern | None:
    """The regex when the pre-tokenizer only splits by it and its matches are the words wherever they cover
    the text and none is empty (tokenizer.py's fast path checks both on each piece): GPT-2's ByteLevel,
    Llama 3 / Qwen2's Split ``Isolated`` (matches and gaps kept) or gpt-oss's Split ``Removed`` with invert
    (matches kept, gaps dropped), then ByteLevel without regex."""
    *first, last = flat if flat else [None]
    if last is None or last.value.get("type") != "ByteLevel" or last.value.get("add_prefix_space"):
        return None
    if not first:
        return gpt2_regex() if last.value.get("use_regex", True) else None
    if len(first) == 1 and not last.value.get("use_regex", True):
        split = first[0].value
        keeps_matches = (split.get("behavior"), bool(split.get("invert"))) in (("Isolated", False), ("Removed", True))
        if split.get("type") == "Split" and keeps_matches:
            return _split_pattern(first[0])
    return None


def _step(node: Node, *, defer_bytes: bool) -> Step:
    kind = node.type_of(SUPPORTED)
    if kind == "ByteLevel":
        prefix = node.get("add_prefix_space", bool, True)
        regex = gpt2_regex() if node.get("use_regex", bool, True) else None
        return lambda pieces: _byte_level(pieces, prefix=prefix, regex=regex, map_bytes=not defer_bytes)
    if kind == "Split":
        pattern = _split_pattern(node)
        behavior = node.get("behavior", str)
        if behavior not in BEHAVIORS:
            raise node.error(f"{behavior!r} is not one of {', '.join(BEHAVIORS)}", "behavior")
        invert = node.get("invert", bool, False)
        return lambda pieces: [p for piece in pieces for p in split(piece, pattern, behavior, invert=invert)]
    if kind == "Digits":
        # digits.rs splits on char::is_numeric: the categories Nd, Nl and No.
        pattern = compile_pattern(r"\p{N}" if node.get("individual_digits", bool, False) else r"\p{N}+")
        return lambda pieces: [p for piece in pieces for p in split(piece, pattern, "Isolated", invert=False)]
    replacement = node.get("replacement", str)
    if len(replacement) != 1:
        raise node.error(f"must be one character, got {replacement!r}", "replacement")
    scheme = node.get("prepend_scheme", str, "always")
    if node.get("add_prefix_space", bool, None) is False:
        scheme = "never"
    if scheme not in ("always", "first", "never"):
        raise node.error(f"{scheme!r} is not one of always, first, never", "prepend_scheme")
    split_on = re.compile(re.escape(replacement)) if node.get("split", bool, True) else None
    return lambda pieces: [p for piece in pieces for p in _metaspace(piece, replacement, scheme, split_on)]


def _split_pattern(node: Node) -> re.Pattern:
    return compile_replace_pattern(node)  # the same {"String"} / {"Regex"} spelling as Replace


def find_matches(pattern: re.Pattern, text: str) -> list[tuple[int, int, bool]]:
    """tokenizers' ``Pattern::find_matches``: the text covered by (start, end, is_match) spans, in order."""
    if not text:
        return [(0, 0, False)]
    spans, previous = [], 0
    for start, end in find_spans(pattern, text):
        if previous != start:
            spans.append((previous, start, False))
        spans.append((start, end, True))
        previous = end
    if previous != len(text):
        spans.append((previous, len(text), False))
    return spans


def split(piece: Piece, pattern: re.Pattern, behavior: str, *, invert: bool) -> list[Piece]:
    """tokenizers' ``NormalizedString::split`` with a SplitDelimiterBehavior (normalizer.rs); ``invert`` flips
    every span's is_match first (pattern.rs ``Invert``). "the-final--countdown" split on "-" (normalizer.rs):

        Removed             the  final  countdown
        Isolated            the  -  final  -  -  countdown
        MergedWithPrevious  the-  final-  -  countdown
        MergedWithNext      the  -final  -  -countdown
        Contiguous          the  -  final  --  countdown
    """
    text, where = piece
    spans = [(s, e, m != invert) for s, e, m in find_matches(pattern, text)]
    kept: list[list] = []  # [start, end, removed]
    if behavior in ("Isolated", "Removed"):
        kept = [[s, e, behavior == "Removed" and m] for s, e, m in spans]
    elif behavior == "Contiguous":
        previous = False
        for s, e, m in spans:
            if m == previous and kept:
                kept[-1][1] = e
            else:
                kept.append([s, e, False])
            previous = m
    elif behavior == "MergedWithPrevious":
        previous = False
        for s, e, m in spans:
            if m and not previous and kept:
                kept[-1][1] = e
            else:
                kept.append([s, e, False])
            previous = m
    else:  # MergedWithNext
        previous = False
        for s, e, m in reversed(spans):
            if m and not previous and kept:
                kept[-1][0] = s
            else:
                kept.append([s, e, False])
            previous = m
        kept.reverse()
    first = START if where == START else MIDDLE
    return [(text[s:e], first if s == 0 else MIDDLE) for s, e, removed in kept if not removed and e > s]


def _byte_level(pieces: list[Piece], *, prefix: bool, regex: re.Pattern | None, map_bytes: bool) -> list[Piece]:
    out = []
    for text, where in pieces:
        if prefix and where != CONTINUED and not text.startswith(" "):
            text = " " + text  # the added space belongs to the piece's first character: ``where`` is kept
        parts = split((text, where), regex, "Isolated", invert=False) if regex else [(text, where)]
        out.extend((byte_level.to_byte_chars(t), s) if map_bytes else (t, s) for t, s in parts if t)
    return out


def _metaspace(piece: Piece, replacement: str, scheme: str, split_on: re.Pattern | None) -> list[Piece]:
    text, where = piece
    text = text.replace(" ", replacement)
    wanted = (scheme == "always" and where != CONTINUED) or (scheme == "first" and where == START)
    if text and wanted and not text.startswith(replacement):
        text = replacement + text
    if split_on is None:
        return [(text, where)] if text else []
    return split((text, where), split_on, "MergedWithNext", invert=False)
