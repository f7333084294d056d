"""Megatron-LM indexed datasets: ``NAME.bin`` (the tokens) with ``NAME.idx`` (the index).

The .idx (NVIDIA/Megatron-LM, megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``):

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        dtype code of the tokens: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q        S, the number of sequences
    <Q        D + 1, the number of document indices
    S  int32  sequence lengths, in tokens
    S  int64  sequence pointers, byte offsets into the .bin
    D+1 int64 document indices: 0, then one past each document's last sequence

(a multimodal index appends S int8 modes). The .bin is the sequences' tokens back to back, which this
engine reads as one token stream, documents and all, as Megatron's GPT dataset does. The index is read
in place (mmap); nothing proportional to S or D is copied.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.data.corpus import DataError, IndexedDocuments, Int64Array
from runtime.engine.data.token_files import TOKEN_DTYPES, TokenFile

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes


def prefix_of(path: str) -> str | None:
    """The dataset prefix when ``path`` names a Megatron pair (the prefix, NAME.bin or NAME.idx), else None."""
    for suffix in (".idx", ".bin"):
        if path.endswith(suffix) and Path(path[: -len(suffix)] + ".idx").is_file():
            return path[: -len(suffix)]
    if Path(path + ".idx").is_file() and Path(path + ".bin").is_file():
        return path
    return None


@dataclass(frozen=True)
class IndexedDataset:
    tokens: TokenFile
    documents: IndexedDocuments
    n_documents: int


def read_indexed_dataset(prefix: str, *, flag: str) -> IndexedDataset:
    """Check the .idx header and sizes against the .bin; DataError naming the file and the field."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if not bin_.is_file():
        raise DataError(f"{flag} {prefix}: {idx} has no {bin_} beside it")
    idx_size = idx.stat().st_size
    if idx_size < _HEADER.size:
        raise DataError(f"{flag} {idx}: {idx_size} bytes, shorter than the {_HEADER.size}-byte Megatron header (truncated)")
    with open(idx, "rb") as f:
        magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise DataError(f"{flag} {idx}: bad magic {magic!r} at byte 0, expected {MAGIC!r} (not a Megatron index)")
    if version != VERSION:
        raise DataError(f"{flag} {idx}: version {version} at byte 9, only version {VERSION} exists")
    dtype = DTYPE_CODES.get(code)
    if dtype not in TOKEN_DTYPES:
        what = f"{dtype} tokens are not token ids" if dtype else "unknown"
        raise DataError(f"{flag} {idx}: dtype code {code} at byte 17 ({what}); valid codes: "
                        + ", ".join(f"{c} {n}" for c, n in DTYPE_CODES.items() if n in TOKEN_DTYPES))
    pointers_at = _HEADER.size + 4 * n_seq
    documents_at = pointers_at + 8 * n_seq
    expected = documents_at + 8 * n_doc_idx
    if idx_size not in (expected, expected + n_seq):  # + n_seq: a multimodal index's modes
        raise DataError(f"{flag} {idx}: the header says {n_seq:,} sequences and {n_doc_idx:,} document indices, "
                        f"i.e. {expected:,} bytes, but the file has {idx_size:,} (truncated or corrupt)")
    with open(idx, "rb") as f:
        buffer = mmap.mmap(f.fileno(), idx_size, access=mmap.ACCESS_READ)
    pointers = Int64Array(buffer, offset=pointers_at, count=n_seq)
    document_indices = Int64Array(buffer, offset=documents_at, count=n_doc_idx)
    itemsize = TOKEN_DTYPES[dtype][1]
    bin_size = bin_.stat().st_size
    if n_seq == 0:
        raise DataError(f"{flag} {idx}: holds no sequences")
    last_length = struct.unpack_from("<i", buffer, _HEADER.size + 4 * (n_seq - 1))[0]
    end = pointers[n_seq - 1] + last_length * itemsize
    if pointers[0] != 0 or end != bin_size:
        raise DataError(f"{flag} {bin_}: the index places its last sequence's end at byte {end:,}, but the file has "
                        f"{bin_size:,} bytes ({'truncated' if bin_size < end else 'not the data this index describes'})")
    if n_doc_idx < 2 or document_indices[0] != 0 or document_indices[n_doc_idx - 1] != n_seq:
        raise DataError(f"{flag} {idx}: the document indices must run from 0 to the sequence count {n_seq:,}")
    return IndexedDataset(TokenFile(bin_, 0, bin_size // itemsize, dtype, f"its .idx dtype code {code}"),
                          IndexedDocuments(pointers, document_indices, itemsize), n_doc_idx - 1)
