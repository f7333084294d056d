"""tokenizer.json normalizers: text -> normalized text, applied to each piece between added tokens.

    NFC NFD NFKC NFKD   unicodedata.normalize (Qwen2/Qwen3: NFC)
    Prepend             prepend a string to a non-empty piece (SentencePiece's legacy "▁")
    Replace             replace a string or an Oniguruma regex (SentencePiece: " " -> "▁")
    Lowercase           each character's full lowercase mapping (Rust's char::to_lowercase: no final-sigma rule)
    Strip               strip White_Space on the left and/or right
    Sequence            each in order
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable

from runtime.tokenizer import unicode_classes as uc
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.regex import UnsupportedPattern, compile_pattern

Normalizer = Callable[[str], str]
SUPPORTED = ("NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace", "Lowercase", "Strip", "Sequence")


def build_normalizer(node: Node, *, prepend: bool = True) -> Normalizer | None:
    """``prepend=False``: the normalizer of a piece that continues one cut off before it (Prepend skipped)."""
    if node.value is None:
        return None
    kind = node.type_of(SUPPORTED)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda text: text if unicodedata.is_normalized(kind, text) else unicodedata.normalize(kind, text)
    if kind == "Prepend":
        prefix = node.get("prepend", str)
        return (lambda text: prefix + text if text else text) if prepend else (lambda text: text)
    if kind == "Replace":
        pattern, content = compile_replace_pattern(node), node.get("content", str)
        return lambda text: pattern.sub(lambda _: content, text)
    if kind == "Lowercase":
        return _lowercase
    if kind == "Strip":
        space = re.compile(uc.char_class(uc.white_space()) + "+")
        left, right = node.get("strip_left", bool, False), node.get("strip_right", bool, False)
        return lambda text: _strip(text, space, left=left, right=right)
    steps = [s for s in (build_normalizer(child, prepend=prepend) for child in node.items("normalizers")) if s is not None]
    return lambda text: _apply_all(steps, text)


def compile_replace_pattern(node: Node) -> re.Pattern:
    """A Replace's ``pattern``: {"String": s} (literal) or {"Regex": r} (Oniguruma)."""
    spec = node.get("pattern", dict)
    if set(spec) == {"String"} and isinstance(spec["String"], str):
        return re.compile(re.escape(spec["String"]))
    if set(spec) == {"Regex"} and isinstance(spec["Regex"], str):
        try:
            return compile_pattern(spec["Regex"])
        except UnsupportedPattern as e:
            raise node.error(f'regex "{spec["Regex"]}": {e}', "pattern") from None
    raise node.error('must be {"String": ...} or {"Regex": ...}', "pattern")


def _strip(text: str, space: re.Pattern, *, left: bool, right: bool) -> str:
    start, end = 0, len(text)
    if left and (m := space.match(text)):
        start = m.end()
    if right:
        while end > start and space.fullmatch(text[end - 1]):
            end -= 1
    return text[start:end]


def _lowercase(text: str) -> str:
    # str.lower turns a word-final Σ into ς; tokenizers lowercases character by character (σ).
    return "".join(c.lower() for c in text) if "\u03a3" in text else text.lower()


def _apply_all(steps: list[Normalizer], text: str) -> str:
    for step in steps:
        text = step(text)
    return text
