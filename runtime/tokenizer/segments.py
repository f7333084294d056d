"""Cutting a long text into segments whose ids, joined, are the whole text's ids.

A corpus file can be one document of gigabytes; tokenizing it whole would hold it and its ids in memory.
It is cut right after a line break that has a non-space character on both sides ("...end.\\nNext..."),
and each segment after the first is encoded with ``continued=True`` (no Prepend "▁" or prefix space in
front of it). That is exact when no pre-tokenizer piece, added token or BPE token spans the cut: the
split regexes of GPT-2, Llama 3 and Qwen2 always end a piece after such a line break, SentencePiece's
"▁" never joins a line break to a letter, and no added token holds one. Rather than trusting a list of
known patterns, ``cut_pattern`` checks a tokenizer on probe texts (every pair of ~20 kinds of line
ends and line starts: letters of several scripts, digits, punctuation, contractions, emoji, marks,
"▁", spaces inside the line) and allows only the cuts that change no ids there, trying "\\n" or "\\r\\n"
first, then "\\n" alone (GPT-2's "\\s+(?!\\S)" reads a line-final "\\r\\n" differently at a text's end); a
tokenizer that fails both is never cut.
"""

from __future__ import annotations

import re
from itertools import product

from runtime.tokenizer import unicode_classes as uc

_LINE_ENDS = ("a", "Hello", "x.", "end,", "12", "3.5", "über", "中文", "🙂", "it's", "a b", " x", "\tx", "a\n\nb",
              "“q”", "$5", "<b>", "\u2581x", "e\u0301", "(", ":", "'", "--", "x  y", "A\u200db")
_LINE_STARTS = ("a", "Hello", "The end", "12", "3.5", "'s", "'S", "'ll", ".", "...", "-x", "Über", "中", "🙂x",
                "\u0301x", "\u2581x", "x y", "(", '"', "#", "<|", "s", "x\n", "x\r\ny", "4 5")


def cut_pattern(tokenizer) -> re.Pattern | None:
    """Where ``tokenizer``'s texts may be cut exactly (a zero-width regex), or None."""
    if any(ch in text for text in (*tokenizer.added.ids, *tokenizer.added.normalized_form.values()) for ch in "\r\n"):
        return None  # an added token could span the cut
    not_space = uc.char_class(uc.complement(uc.white_space()))
    after_lf = f"(?<={not_space}\\n)"
    after_crlf = f"(?<={not_space}\\r\\n)"
    for breaks, lookbehind in ((("\n", "\r\n"), f"(?:{after_lf}|{after_crlf})"), (("\n",), after_lf)):
        if all(_cut_is_exact(tokenizer, left + b, right) for b in breaks for left, right in product(_LINE_ENDS, _LINE_STARTS)):
            return re.compile(f"{lookbehind}(?={not_space})")
    return None


def space_cuts_are_exact(tokenizer) -> bool:
    """Whether a text may be cut before a space that has a non-space character on both sides ("word| next"),
    for tokenizer.py's chunk cache: the same probes, with " " in place of the line break."""
    return all(_cut_is_exact(tokenizer, left, " " + right) for left, right in product(_LINE_ENDS, _LINE_STARTS))


# A space with a non-space on both sides (Python's \s is str.isspace, a superset of Oniguruma's \s, so it never
# allows a wrong cut). The literal space first lets the regex engine jump from space to space.
_SPACE_BETWEEN_WORDS = re.compile(r" (?<=\S )(?=\S)")


def space_chunks(text: str) -> list[str]:
    """``text`` cut before every space with a non-space on both sides, the spaces dropped: the first chunk
    is the text's start, every other one stands for " " + chunk ("the cat sat" -> ["the", "cat", "sat"])."""
    return _SPACE_BETWEEN_WORDS.split(text)


def _cut_is_exact(tokenizer, left: str, right: str) -> bool:
    for split_special in (False, True):
        whole = tokenizer.encode(left + right, split_special_tokens=split_special)
        parts = (tokenizer.encode(left, split_special_tokens=split_special)
                 + tokenizer.encode(right, split_special_tokens=split_special, continued=True))
        if whole != parts:
            return False
    return True


def segments(text: str, cut: re.Pattern | None, *, target_chars: int) -> list[str]:
    """``text`` cut at the first cut point at or after every ``target_chars`` characters (whole when
    ``cut`` is None or there is no cut point)."""
    out, start = [], 0
    while cut is not None and len(text) - start > target_chars:
        m = cut.search(text, start + target_chars)
        if m is None:
            break
        out.append(text[start: m.start()])
        start = m.start()
    out.append(text[start:])
    return out
