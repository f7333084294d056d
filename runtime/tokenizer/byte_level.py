"""GPT-2's byte-level alphabet: each of the 256 bytes as one printable character (openai/gpt-2
src/encoder.py ``bytes_to_unicode``, which Hugging Face's ByteLevel pre-tokenizer and decoder use).

Printable bytes ``!``-``~``, ``¡``-``¬`` and ``®``-``ÿ`` stand for themselves; the other 68 (controls,
space, DEL, NBSP, soft hyphen...) are shifted to U+0100 and up in byte order, so a space is ``Ġ`` (U+0120)
and a newline ``Ċ`` (U+010A). A word's byte-level form is ``to_byte_chars(word)``; decoding maps every
character of a token back to its byte, or, for a token with a character outside the alphabet (an added
token), takes the token's own UTF-8 bytes, as Hugging Face's ByteLevel decoder does.
"""

from __future__ import annotations


def _bytes_to_unicode() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS: list[str] = _bytes_to_unicode()  # byte -> its character
CHAR_BYTES: dict[str, int] = {c: b for b, c in enumerate(BYTE_CHARS)}

# str.translate tables: Latin-1 characters (one per byte) -> byte-level characters, and back. A character
# below 256 that is not in the alphabet maps to a code point no byte has, so encoding to Latin-1 fails.
_TO_CHARS = {b: c for b, c in enumerate(BYTE_CHARS)}
_NOT_A_BYTE = chr(0x10FFFF)
_TO_BYTES = {**{cp: _NOT_A_BYTE for cp in range(256)}, **{ord(c): chr(b) for b, c in enumerate(BYTE_CHARS)}}


def to_byte_chars(word: str) -> str:
    """The UTF-8 bytes of ``word``, one alphabet character each."""
    return word.encode("utf-8").decode("latin-1").translate(_TO_CHARS)


def token_bytes(token: str) -> bytes:
    """The bytes a token stands for: each character's byte, or the token's UTF-8 when one character is
    outside the alphabet (Hugging Face: ``CHAR_BYTES.get(c)`` for all, else ``t.as_bytes()``)."""
    try:
        return token.translate(_TO_BYTES).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def decode(tokens: list[str]) -> str:
    """Hugging Face's ByteLevel decoder: every token's bytes, joined, decoded with U+FFFD for invalid UTF-8
    (Rust's ``from_utf8_lossy`` and Python's "replace" both substitute each maximal invalid subpart)."""
    return b"".join(map(token_bytes, tokens)).decode("utf-8", errors="replace")
