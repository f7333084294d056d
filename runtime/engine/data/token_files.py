"""Token files: the dtypes, memory-mapping a file's tokens with torch, and one pass that checks them.

A token file is read in place: ``torch.from_file`` maps it (MAP_PRIVATE, nothing is read until a window
touches its pages, and the pages are the kernel's page cache, shared by every rank on the machine), and a
window copies only its T + 1 tokens. No rank copies a file or reads one whole to train on it.

``scan`` reads a file once, in 64 MiB chunks into one reused buffer, for its largest and smallest token
(the vocabulary check) and, given an end-of-document token, where that token occurs (the document
index). It costs one sequential read of the file at page-cache speed (~1.6 GB/s measured here: ~6 s
for a 10 GB file) and 64 MiB of memory; the result is cached per machine (cache.py), so only the first
rank of the first run pays it and later runs start at once.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.engine.data.cache import cache_key, exclusive, file_identity, usable, write_atomically
from runtime.engine.data.corpus import DataError, Int64Array

# name -> (torch dtype of the mapped tokens, bytes per token, signed)
TOKEN_DTYPES: dict[str, tuple[torch.dtype, int, bool]] = {
    "uint8": (torch.uint8, 1, False),
    "int8": (torch.int8, 1, True),
    "uint16": (torch.uint16, 2, False),
    "int16": (torch.int16, 2, True),
    "uint32": (torch.uint32, 4, False),
    "int32": (torch.int32, 4, True),
    "int64": (torch.int64, 8, True),
}
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_BYTES = 1 << 26


@dataclass(frozen=True)
class TokenFile:
    """``count`` tokens of ``dtype`` starting ``offset`` bytes into ``path``."""

    path: Path
    offset: int
    count: int
    dtype: str  # a TOKEN_DTYPES name
    dtype_source: str  # what set the dtype, for messages: "--token-dtype", "its llm.c header", ...

    def map(self) -> torch.Tensor:
        """(count,) tokens, memory-mapped."""
        torch_dtype, size, _ = TOKEN_DTYPES[self.dtype]
        raw = torch.from_file(str(self.path), shared=False, size=self.path.stat().st_size, dtype=torch.uint8)
        return raw[self.offset: self.offset + self.count * size].view(torch_dtype)


@dataclass(frozen=True)
class ScanResult:
    largest: int
    largest_at: int  # token offset of its first occurrence
    smallest: int
    smallest_at: int
    eods: Int64Array | None  # sorted token offsets of the end-of-document token, when one was given


def scan(file: TokenFile, *, eod: int | None, cache_dir: Path | None) -> ScanResult:
    """The file's token range and end-of-document offsets; cached per machine when ``cache_dir`` is usable."""
    if cache_dir is None or not usable(cache_dir):
        return _scan(file, eod=eod, eod_path=None)
    key = cache_key("scan", 1, file_identity(file.path), file.offset, file.count, file.dtype, eod)
    summary, eod_path = cache_dir / f"scan-{key}.json", cache_dir / f"scan-{key}.eod"
    with exclusive(cache_dir / f"scan-{key}.lock"):
        if not summary.exists():
            result = _scan(file, eod=eod, eod_path=eod_path)
            fields = {k: getattr(result, k) for k in ("largest", "largest_at", "smallest", "smallest_at")}
            write_atomically(summary, lambda out: out.write(json.dumps(fields).encode()))
            return result
    fields = json.loads(summary.read_text())
    return ScanResult(**fields, eods=_read_eods(eod_path) if eod is not None else None)


def _scan(file: TokenFile, *, eod: int | None, eod_path: Path | None) -> ScanResult:
    _, size, signed = TOKEN_DTYPES[file.dtype]
    bias = 0 if signed else 1 << (8 * size - 1)  # unsigned u is read as the signed u - bias: same order
    buffer = bytearray(CHUNK_BYTES - CHUNK_BYTES % size)
    view = torch.frombuffer(buffer, dtype=_SIGNED[size])
    largest, largest_at, smallest, smallest_at = None, 0, None, 0
    eods: list[torch.Tensor] = []
    done = 0
    with open(file.path, "rb", buffering=0) as f:
        f.seek(file.offset)
        while done < file.count:
            n = f.readinto(memoryview(buffer)[: min(len(buffer), (file.count - done) * size)]) // size
            if n == 0:
                raise DataError(f"{file.path} ends at token {done:,} of the {file.count:,} expected (truncated)")
            chunk = view[:n]
            if bias:
                chunk.bitwise_xor_(-bias)  # flips the sign bit: u -> u - bias
            hi, lo = int(chunk.max()) + bias, int(chunk.min()) + bias
            if largest is None or hi > largest:
                largest, largest_at = hi, done + int(chunk.argmax())
            if smallest is None or lo < smallest:
                smallest, smallest_at = lo, done + int(chunk.argmin())
            if eod is not None:
                eods.append(torch.nonzero(chunk == eod - bias).flatten() + done)
            done += n
    if eod is None:
        return ScanResult(largest, largest_at, smallest, smallest_at, None)
    found = torch.cat(eods) if eods else torch.zeros(0, dtype=torch.int64)
    raw = bytearray(8 * len(found))  # little-endian int64, as Int64Array reads it
    if len(found):
        torch.frombuffer(raw, dtype=torch.int64).copy_(found)
    if eod_path is None:
        return ScanResult(largest, largest_at, smallest, smallest_at, Int64Array(bytes(raw), offset=0, count=len(found)))
    write_atomically(eod_path, lambda out: out.write(raw))
    return ScanResult(largest, largest_at, smallest, smallest_at, _read_eods(eod_path))


def _read_eods(path: Path) -> Int64Array:
    size = path.stat().st_size
    if size == 0:
        return Int64Array(b"", offset=0, count=0)
    with open(path, "rb") as f:
        return Int64Array(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ), offset=0, count=size // 8)


def check_vocabulary(file: TokenFile, result: ScanResult, *, vocab_size: int, flag: str) -> None:
    """DataError unless every token id is in [0, vocab_size)."""
    _, size, _ = TOKEN_DTYPES[file.dtype]
    if result.smallest < 0:
        raise DataError(f"{flag} {file.path}: token {result.smallest} at token offset {result.smallest_at:,} "
                        f"(byte {file.offset + result.smallest_at * size:,}) is negative; the file is read as "
                        f"{file.dtype} ({file.dtype_source}): is that its dtype?")
    if result.largest >= vocab_size:
        hint = " or --token-dtype if the file does not hold " + file.dtype if file.dtype_source == "--token-dtype" else ""
        raise DataError(f"{flag} {file.path}: token {result.largest:,} at token offset {result.largest_at:,} "
                        f"(byte {file.offset + result.largest_at * size:,}) is outside the model's vocabulary "
                        f"(--vocab-size {vocab_size:,}); use --vocab-size {result.largest + 1:,} or more{hint}")


def nanogpt_file(path: Path, *, dtype: str, flag: str) -> TokenFile:
    """A nanoGPT ``.bin``: token ids with no header (``np.uint16`` in its prepare.py scripts)."""
    size = TOKEN_DTYPES[dtype][1]
    n_bytes = path.stat().st_size
    if n_bytes % size:
        raise DataError(f"{flag} {path}: {n_bytes:,} bytes is not a whole number of {dtype} tokens ({size} bytes "
                        f"each): truncated, or not {dtype} (set --token-dtype)")
    if n_bytes == 0:
        raise DataError(f"{flag} {path}: the file is empty")
    return TokenFile(path, 0, n_bytes // size, dtype, "--token-dtype")
