"""Byte-level text: ``builtin`` (CPython's bundled English documentation, ``pydoc_data.topics``, ~470 KB, so
training on real text needs nothing from the network) or the user's UTF-8 ``.txt`` files.

The UTF-8 bytes are the tokens (vocabulary 256). They are written once per machine to a token file in
the data cache (files joined by a newline), under the entry's lock: the first rank validates and copies
the text in 16 MiB pieces, the others wait and map the finished file. A cache hit decodes nothing.
"""

from __future__ import annotations

import codecs
import tempfile
from pathlib import Path

from runtime.engine.data.cache import cache_key, exclusive, file_identity, usable, write_atomically
from runtime.engine.data.corpus import DataError
from runtime.engine.data.token_files import TokenFile

BYTE_VOCAB = 256
TEXT_SUFFIXES = (".txt",)
_PIECE = 1 << 24


def builtin_text() -> bytes:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics)).encode("utf-8")


def text_files(path: Path, *, flag: str) -> list[Path]:
    """A .txt file, or every .txt file under a folder, sorted."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"{flag} {path}: the folder holds no .txt files, llm.c shards or nanoGPT train.bin")
    return files


def builtin_tokens(cache_dir: Path) -> TokenFile:
    data = builtin_text()
    cache_dir = writable_cache(cache_dir)
    path = cache_dir / f"builtin-{cache_key('builtin', data)}.u8"
    with exclusive(path.with_suffix(".lock")):
        if not path.exists():
            write_atomically(path, lambda out: out.write(data))
    return TokenFile(path, 0, len(data), "uint8", "byte-level text")


def text_tokens(files: list[Path], cache_dir: Path) -> TokenFile:
    """The byte tokens of ``files`` joined by newlines; DataError if one is not UTF-8 (naming it and the byte)."""
    cache_dir = writable_cache(cache_dir)
    path = cache_dir / f"{cache_key(*(file_identity(f) for f in files))}.u8"
    with exclusive(path.with_suffix(".lock")):
        if not path.exists():
            write_atomically(path, lambda out: _copy_checked(files, out))
    return TokenFile(path, 0, path.stat().st_size, "uint8", "byte-level text")


def _copy_checked(files: list[Path], out) -> None:
    for i, f in enumerate(files):
        if i:
            out.write(b"\n")
        decoder, done = codecs.getincrementaldecoder("utf-8")(), 0
        with open(f, "rb") as src:
            while piece := src.read(_PIECE):
                try:
                    decoder.decode(piece)
                except UnicodeDecodeError as e:
                    raise DataError(f"--data: {f} is not UTF-8 text (invalid byte at offset {done + e.start:,})") from None
                out.write(piece)
                done += len(piece)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"--data: {f} is not UTF-8 text (it ends inside a character)") from None


def writable_cache(cache_dir: Path) -> Path:
    """The cache folder, or a private temporary one when it cannot be written (a read-only home)."""
    if usable(cache_dir):
        return cache_dir
    fallback = Path(tempfile.gettempdir()) / "hybrid_engine_tokens"
    if not usable(fallback):
        raise DataError(f"cannot write the byte-token cache to {cache_dir} or {fallback}")
    return fallback
