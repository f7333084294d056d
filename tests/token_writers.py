"""Independent writers of the three token-file formats, from their published specifications (struct and the
token bytes only), for the readers' tests:

- nanoGPT (karpathy/nanoGPT data/*/prepare.py): the token ids as a flat array, no header (np.uint16).
- llm.c (karpathy/llm.c dev/data/data_common.py ``write_datafile``): 256 little-endian int32 (magic,
  version, token count, zeros), then the tokens: magic 20240520 / version 1 / uint16 or magic 20240801 /
  version 7 / uint32.
- Megatron-LM (megatron/core/datasets/indexed_dataset.py ``_IndexWriter``): NAME.bin holds the documents'
  tokens back to back; NAME.idx holds b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count,
  <Q document-index count, int32 lengths, int64 byte pointers, int64 document indices (0, then one past
  each document's last sequence).
"""

from __future__ import annotations

import struct
from pathlib import Path

# token dtype -> struct format character (little-endian), bytes per token
STRUCT = {"uint8": ("B", 1), "int8": ("b", 1), "uint16": ("H", 2), "int16": ("h", 2), "uint32": ("I", 4),
          "int32": ("i", 4), "int64": ("q", 8)}
MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def pack(tokens: list[int], dtype: str) -> bytes:
    char, _ = STRUCT[dtype]
    return struct.pack(f"<{len(tokens)}{char}", *tokens)


def write_nanogpt(path: Path, tokens: list[int], dtype: str = "uint16") -> Path:
    path.write_bytes(pack(tokens, dtype))
    return path


def write_llmc(path: Path, tokens: list[int], *, version: int = 1) -> Path:
    magic, dtype = {1: (20240520, "uint16"), 7: (20240801, "uint32")}[version]
    header = [magic, version, len(tokens)] + [0] * 253
    path.write_bytes(struct.pack("<256i", *header) + pack(tokens, dtype))
    return path


def write_megatron(prefix: Path, documents: list[list[int]], dtype: str = "uint16", *,
                   sentences_per_document: int = 1) -> Path:
    """Each document split into ``sentences_per_document`` sequences (Megatron's --split-sentences)."""
    _, itemsize = STRUCT[dtype]
    lengths, document_indices, data = [], [0], b""
    for doc in documents:
        cut = [len(doc) * i // sentences_per_document for i in range(sentences_per_document + 1)]
        for a, b in zip(cut, cut[1:]):
            lengths.append(b - a)
        document_indices.append(len(lengths))
        data += pack(doc, dtype)
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    Path(str(prefix) + ".bin").write_bytes(data)
    index = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype])
             + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
             + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
             + struct.pack(f"<{len(document_indices)}q", *document_indices))
    Path(str(prefix) + ".idx").write_bytes(index)
    return prefix
