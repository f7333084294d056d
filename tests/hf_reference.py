"""An independent safetensors writer and parser for the tests, from the published format alone
(github.com/huggingface/safetensors README "Format"): ``struct`` and ``json``, no torch, no code of ours.

    8 bytes little-endian u64 N | N bytes UTF-8 JSON header | byte buffer

The header maps each name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the buffer)
and may hold "__metadata__" (str -> str); each tensor's bytes are little-endian, C order.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# Element sizes in bytes, from the format's dtype list.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
# Python values -> little-endian bytes (struct codes); the 8-bit floats are given as raw bytes.
_STRUCT = {"BOOL": "?", "U8": "B", "I8": "b", "I16": "h", "U16": "H", "F16": "e", "I32": "i", "U32": "I",
           "F32": "f", "I64": "q", "U64": "Q", "F64": "d"}


def pack(dtype: str, values: list) -> bytes:
    """Little-endian bytes of ``values`` (flat, C order) as the format stores ``dtype``."""
    if dtype in _STRUCT:
        return struct.pack(f"<{len(values)}{_STRUCT[dtype]}", *values)
    if dtype == "BF16":  # the upper half of a float32 (values chosen exactly representable)
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    if dtype == "C64":  # (real, imaginary) float32 pairs
        return b"".join(struct.pack("<ff", v.real, v.imag) for v in values)
    if dtype.startswith("F8_"):
        return bytes(values)
    raise ValueError(dtype)


def unpack(dtype: str, raw: bytes) -> list:
    if dtype in _STRUCT:
        return list(struct.unpack(f"<{len(raw) // ITEMSIZE[dtype]}{_STRUCT[dtype]}", raw))
    if dtype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    if dtype == "C64":
        return [complex(*struct.unpack("<ff", raw[i:i + 8])) for i in range(0, len(raw), 8)]
    return list(raw)


def header_prefix(entries: list[tuple[str, str, list[int], int]], *, metadata: dict | None = None,
                  spaces: int | None = None, order: list[str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The 8-byte length and the header for ``(name, dtype, shape, nbytes)`` laid out in list order.

    ``spaces``: how many trailing spaces to pad with (None: up to a multiple of 8, as writers do);
    ``order``: the order of the keys in the JSON (any order is valid)."""
    offsets, at = {}, 0
    for name, _dtype, _shape, nbytes in entries:
        offsets[name] = (at, at + nbytes)
        at += nbytes
    info = {name: {"dtype": dtype, "shape": shape, "data_offsets": list(offsets[name])}
            for name, dtype, shape, _ in entries}
    header = {"__metadata__": metadata} if metadata is not None else {}
    header.update({name: info[name] for name in (order or list(info))})
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((-len(text) % 8) if spaces is None else spaces)
    return struct.pack("<Q", len(text)) + text, offsets


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], **layout) -> None:
    """``tensors``: name -> (dtype, shape, raw bytes), stored in dict order."""
    entries = [(name, dtype, shape, len(raw)) for name, (dtype, shape, raw) in tensors.items()]
    prefix, _ = header_prefix(entries, **layout)
    Path(path).write_bytes(prefix + b"".join(raw for _, _, raw in tensors.values()))


def parse_safetensors(path: Path) -> tuple[int, dict, dict[str, tuple[str, list[int], bytes]]]:
    """(header length N, metadata, name -> (dtype, shape, raw bytes)), checking the format's rules."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    buffer = data[8 + n:]
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
    end = 0
    for begin, stop, name in spans:  # no holes, no overlaps, the whole buffer
        assert begin == end, (name, begin, end)
        end = stop
    assert end == len(buffer)
    tensors = {}
    for name, info in header.items():
        begin, stop = info["data_offsets"]
        assert stop - begin == math.prod(info["shape"]) * ITEMSIZE[info["dtype"]], name
        tensors[name] = (info["dtype"], info["shape"], buffer[begin:stop])
    return n, metadata, tensors


def write_index(path: Path, weight_map: dict[str, str], total_size: int) -> None:
    """A Hugging Face ``*.index.json`` as transformers writes it."""
    Path(path).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                                     indent=2, sort_keys=True) + "\n")
