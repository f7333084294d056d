"""llm.c token shards (karpathy/llm.c, dev/data/data_common.py ``write_datafile``, llmc/dataloader.h).

A shard is a 1,024-byte header of 256 little-endian int32, then the tokens: [0] the magic, [1] the
version, [2] the token count; the rest is zero. Magic 20240520 with version 1 holds uint16 tokens
(GPT-2), magic 20240801 with version 7 uint32 tokens (Llama 3). The file holds exactly
1024 + count x token size bytes (llm.c's loader refuses any other size). Shards are named
``*_train_*.bin`` and ``*_val_*.bin``; each document starts with the end-of-text token.
"""

from __future__ import annotations

import glob
import struct
from pathlib import Path

from runtime.engine.data.corpus import DataError
from runtime.engine.data.token_files import TokenFile

HEADER_BYTES = 1024
FORMATS = {20240520: (1, "uint16"), 20240801: (7, "uint32")}  # magic -> (version, token dtype)


def has_llmc_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<i", head)[0] in FORMATS


def looks_like_shard(path: Path) -> bool:
    """Named as llm.c names its shards (its header is then required, not guessed)."""
    return path.suffix == ".bin" and ("_train_" in path.name or "_val_" in path.name)


def read_shard(path: Path, *, flag: str) -> TokenFile:
    """The shard's tokens, after checking its header against the file; DataError naming the field."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{flag} {path}: {size:,} bytes, shorter than llm.c's {HEADER_BYTES:,}-byte header "
                        f"(truncated, or not an llm.c shard)")
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    if magic not in FORMATS:
        known = ", ".join(f"{m} (version {v}, {d})" for m, (v, d) in FORMATS.items())
        raise DataError(f"{flag} {path}: bad llm.c magic {magic} at byte 0 (valid: {known}); for a headerless "
                        f"nanoGPT file name it without _train_/_val_ or give --data-format nanogpt")
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise DataError(f"{flag} {path}: llm.c magic {magic} needs version {want_version}, the header at byte 4 "
                        f"says {version}")
    itemsize = 2 if dtype == "uint16" else 4
    expected = HEADER_BYTES + count * itemsize
    if count <= 0 or size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{flag} {path}: the header (byte 8) says {count:,} {dtype} tokens, i.e. {expected:,} "
                        f"bytes with the header, but the file has {size:,} bytes ({state})")
    return TokenFile(path, HEADER_BYTES, count, dtype, "its llm.c header")


def split_shards(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training shards, validation shards): ``*_val_*`` names are the validation split."""
    val = [f for f in files if "_val_" in f.name]
    train = [f for f in files if f not in val]
    return (train, val) if train else (val, [])


def expand(pattern: str) -> list[Path]:
    """The shards a glob names, sorted (as llm.c's loader takes them)."""
    return sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())


def sibling_val_shards(shard: Path) -> list[Path]:
    """For one ``X_train_N.bin``, the ``X_val_*.bin`` beside it."""
    if "_train_" not in shard.name:
        return []
    prefix = shard.name.split("_train_")[0]
    return expand(str(shard.parent / glob.escape(prefix)) + "_val_*.bin")
