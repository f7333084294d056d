"""Loss-mask files: which tokens of a token file a supervised fine-tuning loss trains on, and where each
conversation begins.

A mask file lies beside its token file, named as it with the suffix ``.mask`` (nanoGPT ``train.bin`` ->
``train.mask``, Megatron ``NAME.bin`` + ``NAME.idx`` -> ``NAME.mask``). It holds one byte per token of the token
file (a header, where the format has one, excluded) and nothing else:

    bit 0 (1)  trained: the token belongs to an assistant turn (its content and end-of-turn marker), so the loss
               predicts it
    bit 1 (2)  the token is the first of a conversation

so every byte is 0 to 3, and the first byte has bit 1 set. Conversations are the runs of tokens from one start
to the next; a mask carries them itself, so any token format can hold chat data.

``conversations`` reads a mask once, in chunks, for each conversation's start and trained-token count (cached per
machine, as token-file scans are: cache.py), never holding the mask in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.engine.data.cache import cache_key, exclusive, file_identity, usable, write_atomically
from runtime.engine.data.corpus import DataError

MASK_SUFFIX = ".mask"
TRAINED, STARTS = 1, 2  # the two bits
CHUNK_BYTES = 1 << 22  # the mask is read in chunks of this many tokens (the running counts are int64: 8x this)


def mask_path(token_path: Path) -> Path:
    """Where the mask of ``token_path`` lies (``NAME.bin`` -> ``NAME.mask``)."""
    return token_path.with_suffix(MASK_SUFFIX)


def mask_byte(*, trained: bool, starts: bool) -> int:
    return (TRAINED if trained else 0) | (STARTS if starts else 0)


@dataclass(frozen=True)
class Conversations:
    """The conversations of one token file, from its mask: int64 tensors of one entry each."""

    starts: torch.Tensor  # (N,) token offset of each conversation's first token
    lengths: torch.Tensor  # (N,) its tokens
    trained: torch.Tensor  # (N,) its trained tokens

    def __len__(self) -> int:
        return len(self.starts)


def map_mask(path: Path, *, count: int, flag: str) -> torch.Tensor:
    """(count,) uint8, memory-mapped; DataError unless the file holds exactly ``count`` bytes."""
    size = path.stat().st_size
    if size != count:
        raise DataError(f"{flag} {path}: {size:,} bytes, but its token file holds {count:,} tokens (a mask holds one "
                        f"byte per token)")
    if size == 0:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def conversations(path: Path, *, count: int, flag: str, cache_dir: Path | None) -> Conversations:
    """Each conversation of the mask at ``path`` (one byte per token of a ``count``-token file); cached per machine
    when ``cache_dir`` is usable. DataError naming the file and offset for a byte outside 0-3 or a file that does
    not start a conversation at its first token."""
    if cache_dir is None or not usable(cache_dir):
        return _scan(path, count=count, flag=flag)
    key = cache_key("mask", 1, file_identity(path), count)
    starts_path, trained_path = cache_dir / f"mask-{key}.starts", cache_dir / f"mask-{key}.trained"
    with exclusive(cache_dir / f"mask-{key}.lock"):
        if not trained_path.exists():
            found = _scan(path, count=count, flag=flag)
            write_atomically(starts_path, lambda out: out.write(_int64_bytes(found.starts)))
            write_atomically(trained_path, lambda out: out.write(_int64_bytes(found.trained)))
            return found
    starts, trained = _read_int64(starts_path), _read_int64(trained_path)
    return Conversations(starts, _lengths(starts, count), trained)


def _scan(path: Path, *, count: int, flag: str) -> Conversations:
    mask = map_mask(path, count=count, flag=flag)
    starts, trained_before = [], []  # per conversation: its start, the trained tokens before it
    done = 0  # trained tokens before the chunk
    for lo in range(0, count, CHUNK_BYTES):
        chunk = mask[lo: lo + CHUNK_BYTES]
        if int(chunk.max()) > TRAINED | STARTS:
            at = lo + int(torch.nonzero(chunk > TRAINED | STARTS)[0])
            raise DataError(f"{flag} {path}: byte {at:,} is {int(mask[at])}, not a mask value (0-3: bit 0 trained, "
                            f"bit 1 starts a conversation)")
        bits = (chunk & TRAINED).long()
        here = torch.nonzero(chunk & STARTS).flatten()  # (n,) starts in the chunk
        starts.append(here + lo)
        trained_before.append(done + bits.cumsum(0)[here] - bits[here])
        done += int(bits.sum())
    starts_t = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64)
    if count and (len(starts_t) == 0 or int(starts_t[0]) != 0):
        raise DataError(f"{flag} {path}: the first token does not start a conversation (bit 1 of byte 0 is clear)")
    before = torch.cat(trained_before) if trained_before else torch.zeros(0, dtype=torch.int64)
    trained = torch.diff(before, append=torch.tensor([done]))
    return Conversations(starts_t, _lengths(starts_t, count), trained)


def _lengths(starts: torch.Tensor, count: int) -> torch.Tensor:
    return torch.diff(starts, append=torch.tensor([count], dtype=torch.int64))


def _int64_bytes(values: torch.Tensor) -> bytes:
    raw = bytearray(8 * values.numel())  # little-endian int64, as _read_int64 maps it
    if values.numel():
        torch.frombuffer(raw, dtype=torch.int64).copy_(values)
    return bytes(raw)


def _read_int64(path: Path) -> torch.Tensor:
    size = path.stat().st_size
    if size == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_file(str(path), shared=False, size=size // 8, dtype=torch.int64).clone()

