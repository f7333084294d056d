"""tokenizer.json decoders: a list of token strings -> text, as tokenizers' ``decode_chain`` then join.

    ByteLevel     every token's bytes (byte_level.py), one string, invalid UTF-8 as U+FFFD
    Replace       a string or regex replaced in each token (SentencePiece: "▁" -> " ")
    ByteFallback  runs of <0xNN> tokens -> their UTF-8 text, or one U+FFFD per byte when invalid
    Fuse          all tokens into one
    Strip         up to ``start`` / ``stop`` copies of ``content`` off each token's ends
    Metaspace     "▁" -> " ", but dropped in the first token unless prepend_scheme is never
    Sequence      each in order
Without a decoder, tokens are joined with spaces (tokenizers' default).
"""

from __future__ import annotations

import re
from typing import Callable

from runtime.tokenizer import byte_level
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.normalizers import compile_replace_pattern

Decoder = Callable[[list[str]], list[str]]
SUPPORTED = ("ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace", "Sequence")
_BYTE_TOKEN = re.compile(r"<0x(\+?[0-9A-Fa-f]{1,2})>")  # Rust's u8::from_str_radix takes a leading "+"


def build_decoder(node: Node) -> Callable[[list[str]], str]:
    if node.value is None:
        return " ".join
    chain = _decoder(node)
    return lambda tokens: "".join(chain(tokens))


def _decoder(node: Node) -> Decoder:
    kind = node.type_of(SUPPORTED)
    if kind == "ByteLevel":
        return lambda tokens: [byte_level.decode(tokens)]
    if kind == "Replace":
        pattern, content = compile_replace_pattern(node), node.get("content", str)
        return lambda tokens: [pattern.sub(lambda _: content, t) for t in tokens]
    if kind == "ByteFallback":
        return _byte_fallback
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Strip":
        content, start, stop = node.get("content", str), node.get("start", int), node.get("stop", int)
        if len(content) != 1:
            raise node.error(f"must be one character, got {content!r}", "content")
        return lambda tokens: [_strip(t, content, start, stop) for t in tokens]
    if kind == "Metaspace":
        replacement = node.get("replacement", str)
        scheme = node.get("prepend_scheme", str, "always")
        if node.get("add_prefix_space", bool, None) is False:
            scheme = "never"
        return lambda tokens: [t.replace(replacement, "" if i == 0 and scheme != "never" else " ")
                               for i, t in enumerate(tokens)]
    steps = [_decoder(child) for child in node.items("decoders")]

    def sequence(tokens: list[str]) -> list[str]:
        for step in steps:
            tokens = step(tokens)
        return tokens
    return sequence


def _byte_fallback(tokens: list[str]) -> list[str]:
    out: list[str] = []
    pending = bytearray()

    def flush() -> None:
        if pending:
            try:
                out.append(pending.decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" * len(pending))
            pending.clear()

    for token in tokens:
        m = _BYTE_TOKEN.fullmatch(token) if len(token.encode("utf-8")) == 6 else None
        if m:
            pending.append(int(m.group(1), 16))
        else:
            flush()
            out.append(token)
    flush()
    return out


def _strip(token: str, content: str, start: int, stop: int) -> str:
    begin = 0
    while begin < min(start, len(token)) and token[begin] == content:
        begin += 1
    end = len(token)
    while len(token) - end < stop and end > begin and token[end - 1] == content:
        end -= 1
    return token[begin:end]
