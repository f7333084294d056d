"""Writing token files, streamed, in the three formats ``--data`` reads (the same specifications as
token_files.py, llmc.py and megatron.py, and as the tools that write them):

    nanogpt   DIR/train.bin (and DIR/val.bin): the ids, no header (nanoGPT's prepare.py: np.uint16 when the
              vocabulary fits 16 bits, else uint32 here)
    llmc      NAME_train_000000.bin ... and NAME_val_000000.bin: 256 int32 header (magic 20240520 version 1
              uint16, or magic 20240801 version 7 uint32) + ids, ``shard_tokens`` ids per shard (llm.c's
              dev/data/data_common.py write_datafile; fineweb.py fills 10^8-token shards)
    megatron  NAME.bin + NAME.idx (and NAME_val.*): MMIDIDX index of one sequence per document; uint16
              when the vocabulary is under 65,500, else int32 (Megatron-LM's DType.optimal_dtype)
    masks     NAME.mask beside a token file of chat data: a byte per token (loss_mask.py)

Memory does not grow with the corpus: ids go straight to the files; Megatron's index needs every
document's length, kept as 4 bytes each (``array('i')``) and written at the end, pointers and document
indices computed a million at a time. Files are written under temporary names and renamed when the
writer closes, so a crash never leaves a file that looks finished.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from itertools import accumulate
from pathlib import Path

from runtime.atomic import publish, temporary_beside
from runtime.engine.data import llmc, megatron

FORMATS = ("nanogpt", "llmc", "megatron")
TYPECODES = {"uint16": "H", "uint32": "I", "int32": "i"}  # token dtype -> array typecode (2 or 4 bytes)
LLMC_SHARD_TOKENS = 10**8
_CHUNK = 1 << 20


def token_dtype(fmt: str, vocab_size: int) -> str:
    """The dtype each format's own tools choose for a vocabulary of ``vocab_size`` ids."""
    if fmt == "megatron":
        return "uint16" if vocab_size < 65500 else "int32"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _Files:
    """Temporary files published together (renamed) on ``publish``, or removed on ``discard``."""

    def __init__(self):
        self.pending: list[tuple[Path, Path]] = []
        self.created: list[Path] = []  # folders made for the files, removed again on discard

    def open(self, final: Path):
        missing = [p for p in (final.parent, *final.parent.parents) if not p.exists()]
        final.parent.mkdir(parents=True, exist_ok=True)
        self.created.extend(missing)
        fd, tmp = temporary_beside(final)
        self.pending.append((tmp, final))
        return os.fdopen(fd, "w+b")

    def publish(self) -> list[Path]:
        for tmp, final in self.pending:
            publish(tmp, final)
        return [final for _, final in self.pending]

    def discard(self) -> None:
        for tmp, _ in self.pending:
            tmp.unlink(missing_ok=True)
        for folder in self.created:  # deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


class _OneFile:
    """A writer of one file at a time (``out``, opened by ``files``): ``close`` publishes, ``abort`` discards."""

    out: object
    files: _Files

    def close(self) -> list[Path]:
        self.out.close()
        return self.files.publish()

    def abort(self) -> None:
        self.out.close()
        self.files.discard()


class TokenWriter:
    """``add(ids_bytes, ends_document)`` for every piece of every document, then ``close()`` (or ``abort()``).
    ``ids_bytes``: little-endian ids of ``dtype``, as array(TYPECODES[dtype]).tobytes() gives them."""

    dtype: str
    tokens: int = 0
    documents: int = 0

    def add(self, ids: bytes, *, ends_document: bool) -> None:
        raise NotImplementedError

    def close(self) -> list[Path]:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class NanoGPTWriter(_OneFile, TokenWriter):
    def __init__(self, path: Path, dtype: str):
        self.dtype, self.files = dtype, _Files()
        self.out = self.files.open(path)

    def add(self, ids: bytes, *, ends_document: bool) -> None:
        self.out.write(ids)
        self.tokens += len(ids) // struct.calcsize(TYPECODES[self.dtype])
        self.documents += ends_document



class LlmcWriter(TokenWriter):
    """``{prefix}_{split}_{index:06d}.bin`` shards of ``shard_tokens`` ids (a document may span two)."""

    def __init__(self, prefix: Path, split: str, dtype: str, *, shard_tokens: int = LLMC_SHARD_TOKENS):
        self.prefix, self.split, self.dtype, self.shard_tokens = prefix, split, dtype, shard_tokens
        self.magic = next(m for m, (_, d) in llmc.FORMATS.items() if d == dtype)
        self.itemsize = struct.calcsize(TYPECODES[dtype])
        self.files, self.out, self.in_shard, self.shards = _Files(), None, 0, 0

    def add(self, ids: bytes, *, ends_document: bool) -> None:
        view = memoryview(ids)
        while len(view):
            if self.out is None:
                self.out = self.files.open(Path(f"{self.prefix}_{self.split}_{self.shards:06d}.bin"))
                self.out.write(bytes(llmc.HEADER_BYTES))  # the header is written when the shard's count is known
            take = min(len(view) // self.itemsize, self.shard_tokens - self.in_shard)
            self.out.write(view[: take * self.itemsize])
            view, self.in_shard, self.tokens = view[take * self.itemsize:], self.in_shard + take, self.tokens + take
            if self.in_shard == self.shard_tokens:
                self._finish_shard()
        self.documents += ends_document

    def _finish_shard(self) -> None:
        version = llmc.FORMATS[self.magic][0]
        self.out.seek(0)
        self.out.write(struct.pack("<256i", self.magic, version, self.in_shard, *([0] * 253)))
        self.out.close()
        self.out, self.in_shard, self.shards = None, 0, self.shards + 1

    def close(self) -> list[Path]:
        if self.out is not None:
            self._finish_shard()
        return self.files.publish()

    def abort(self) -> None:
        if self.out is not None:
            self.out.close()
        self.files.discard()


class MegatronWriter(TokenWriter):
    def __init__(self, prefix: Path, dtype: str):
        self.prefix, self.dtype = prefix, dtype
        self.itemsize = struct.calcsize(TYPECODES[dtype])
        self.files = _Files()
        self.bin = self.files.open(Path(f"{prefix}.bin"))
        self.lengths = array("i")  # tokens per document: 4 bytes each
        self.current = 0

    def add(self, ids: bytes, *, ends_document: bool) -> None:
        self.bin.write(ids)
        n = len(ids) // self.itemsize
        self.current += n
        self.tokens += n
        if ends_document:
            if self.current >= 1 << 31:
                raise ValueError(f"{self.prefix}.bin: a document of {self.current:,} tokens; Megatron's index "
                                 f"stores lengths as int32")
            self.lengths.append(self.current)
            self.current, self.documents = 0, self.documents + 1

    def close(self) -> list[Path]:
        self.bin.close()
        code = next(c for c, name in megatron.DTYPE_CODES.items() if name == self.dtype)
        n = len(self.lengths)
        with self.files.open(Path(f"{self.prefix}.idx")) as idx:
            idx.write(megatron.MAGIC + struct.pack("<QBQQ", megatron.VERSION, code, n, n + 1))
            _write_little_endian(idx, self.lengths)
            at = 0
            for start in range(0, n, _CHUNK):
                chunk = self.lengths[start: start + _CHUNK]
                pointers = array("q", accumulate((length * self.itemsize for length in chunk[:-1]), initial=at))
                at = pointers[-1] + chunk[-1] * self.itemsize
                _write_little_endian(idx, pointers)
            for start in range(0, n + 1, _CHUNK):
                _write_little_endian(idx, array("q", range(start, min(n + 1, start + _CHUNK))))
        return self.files.publish()

    def abort(self) -> None:
        self.bin.close()
        self.files.discard()


class MaskWriter(_OneFile):
    """A loss-mask file (loss_mask.py) written streaming beside a token file: ``add`` each conversation's bytes,
    then ``close`` (published under its final name) or ``abort``."""

    def __init__(self, path: Path):
        self.files = _Files()
        self.out = self.files.open(path)
        self.tokens = 0

    def add(self, mask: bytes) -> None:
        self.out.write(mask)
        self.tokens += len(mask)



def _write_little_endian(f, values: array) -> None:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    values.tofile(f)


def little_endian(values: array) -> bytes:
    """``values`` as the little-endian bytes every format stores."""
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()
