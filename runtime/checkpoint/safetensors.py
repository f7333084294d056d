"""safetensors files, read and written with torch and the standard library (no ``safetensors`` package).

The format (github.com/huggingface/safetensors, README "Format"; validation as its reference reader,
``safetensors/src/tensor.rs``, does it)::

    8 bytes      N, little-endian u64
    N bytes      UTF-8 JSON: {"__metadata__": {str: str} (optional),
                              name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
                 writers pad it with spaces so that the data starts 8-byte aligned
    the rest     the byte buffer: each tensor's little-endian, C-order bytes at [begin, end) of it;
                 together they cover the buffer exactly (no holes, no overlaps)

Reading parses and checks only the header; ``read(name)`` maps just that tensor's pages (copy-on-write),
so a rank that reads some tensors, or a slice of one, reads only those bytes from disk. Sharded folders
use Hugging Face's names: ``model.safetensors`` or ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from runtime.atomic import AtomicWriteError, atomic_file
from runtime.checkpoint.files import CheckpointError

HEADER_LIMIT = 100_000_000  # bytes; the reference reader refuses larger headers (MAX_HEADER_SIZE)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' save_pretrained max_shard_size="5GB" (10**9, as HF parses it)
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_CHUNK = 16 << 20  # bytes copied per write: a writer holds at most this much beyond its tensors

# Format name -> torch dtype, for every dtype this torch has (F8_E8M0 and the unsigned ints are recent).
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("U16", "uint16"),
    ("I32", "int32"), ("U32", "uint32"), ("I64", "int64"), ("U64", "uint64"),
    ("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"), ("F64", "float64"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
    ("C64", "complex64"),
) if hasattr(torch, attr)}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class TensorFileError(CheckpointError):
    """A tensor file or model folder that cannot be read or written; the message names the file and
    the tensor. A CheckpointError, so the commands print it as one ``error:`` line and exit 2."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # [begin, end): bytes of the data buffer, which starts after the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    data_start: int  # 8 + N: where the byte buffer starts in the file
    tensors: dict[str, TensorEntry]  # in the header's order
    metadata: dict[str, str]


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and check a file's header (reads 8 + N bytes, no tensor data)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise TensorFileError(f"{path}: truncated: {size} bytes, too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > HEADER_LIMIT:
                raise TensorFileError(f"{path}: header length {n} exceeds the format's {HEADER_LIMIT} bytes: "
                                      f"not a safetensors file?")
            if 8 + n > size:
                raise TensorFileError(f"{path}: truncated: the header needs {n} bytes after the first 8, "
                                      f"the file holds {size - 8}")
            raw = f.read(n)
    except OSError as e:
        raise TensorFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=refuse_duplicate_keys(path))
    except UnicodeDecodeError:
        raise TensorFileError(f"{path}: the header is not UTF-8 text: not a safetensors file?") from None
    except json.JSONDecodeError as e:
        raise TensorFileError(f"{path}: the header is not valid JSON ({e.msg} at byte {e.pos})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    _check_layout(path, list(entries.values()), buffer_size=size - 8 - n)
    return SafetensorsHeader(path=path, file_size=size, data_start=8 + n, tensors=entries, metadata=metadata)


def refuse_duplicate_keys(path: Path, listed_twice: str = "the header lists {!r} twice"):
    """A ``json.loads`` object_pairs_hook that refuses a key given twice (JSON allows it; the last would
    silently win): ``listed_twice`` says so, formatted with the key, after ``path``."""
    def pairs_to_dict(pairs: list[tuple[str, object]]) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise TensorFileError(f"{path}: {listed_twice.format(key)}")
            out[key] = value
        return out
    return pairs_to_dict


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(path: Path, name: str, info: object) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise TensorFileError(f"{where}: entry must hold dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
        raise TensorFileError(f"{where}: dtype {dtype!r} cannot be read by this torch {torch.__version__} "
                              f"(it reads {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise TensorFileError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise TensorFileError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    entry = TensorEntry(name=name, dtype=DTYPES[dtype], shape=tuple(shape), begin=offsets[0], end=offsets[1])
    needed = math.prod(entry.shape) * entry.dtype.itemsize
    if entry.nbytes != needed:
        raise TensorFileError(f"{where}: shape {list(shape)} of {dtype} needs {needed} bytes, "
                              f"its data_offsets {offsets} span {entry.nbytes}")
    return entry


def _check_layout(path: Path, entries: list[TensorEntry], *, buffer_size: int) -> None:
    """The tensors tile the buffer: sorted by offset, each starts where the previous one ends."""
    covered, previous = 0, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < covered:
            raise TensorFileError(f"{path}: tensor {e.name!r} (bytes {e.begin}..{e.end}) overlaps tensor "
                                  f"{previous.name!r} (bytes {previous.begin}..{previous.end})")
        if e.begin > covered:
            raise TensorFileError(f"{path}: bytes {covered}..{e.begin} of the data, before tensor {e.name!r}, "
                                  f"belong to no tensor")
        covered, previous = e.end, e
    if covered > buffer_size:
        cut = min((e for e in entries if e.end > buffer_size), key=lambda e: e.begin)
        raise TensorFileError(f"{path}: truncated: tensor {cut.name!r} needs data bytes {cut.begin}..{cut.end}, "
                              f"the file holds {buffer_size} bytes of data")
    if covered < buffer_size:
        extra = buffer_size - covered
        raise TensorFileError(f"{path}: {extra} byte{'s' * (extra != 1)} after the last tensor belong to no tensor")


class SafetensorsReader:
    """One file's tensors, each read on demand: ``read`` maps only that tensor's pages."""

    def __init__(self, header: SafetensorsHeader):
        self.header = header

    @classmethod
    def open(cls, path: str | os.PathLike) -> SafetensorsReader:
        return cls(read_header(path))

    @property
    def path(self) -> Path:
        return self.header.path

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    def names(self) -> list[str]:
        return list(self.header.tensors)

    def entry(self, name: str) -> TensorEntry:
        if name not in self.header.tensors:
            raise TensorFileError(f"{self.path}: no tensor {name!r} (it holds {len(self.header.tensors)})")
        return self.header.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        """The tensor, backed by a private copy-on-write mapping of its own bytes: nothing is read from
        disk until touched, so narrowing it and copying the part one needs reads only that part, and
        writing to it never changes the file. The mapping goes when the tensor does."""
        entry = self.entry(name)
        _require_little_endian(self.path)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        start = self.header.data_start + entry.begin
        skip = start % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a granule (a multiple of 8)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size != self.header.file_size:  # touching pages past a new end: SIGBUS
                    raise TensorFileError(f"{self.path}: changed size since its header was read "
                                          f"(tensor {name!r})")
                mapped = mmap.mmap(f.fileno(), skip + entry.nbytes, access=mmap.ACCESS_COPY, offset=start - skip)
        except OSError as e:
            raise TensorFileError(f"{self.path}: tensor {name!r} cannot be read ({e.strerror or e})") from None
        if skip % entry.dtype.itemsize:
            # A writer that did not align this tensor (the format allows it): copy into aligned memory.
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=skip).clone()
            return flat.view(entry.dtype).view(entry.shape)
        # The tensor holds the mapping (buffer protocol) alive; ours may go.
        flat = torch.frombuffer(mapped, dtype=entry.dtype, count=entry.nbytes // entry.dtype.itemsize, offset=skip)
        return flat.view(entry.shape)


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a file, each backed by its own mapping (read from disk as touched)."""
    reader = SafetensorsReader.open(path)
    return {name: reader.read(name) for name in reader.names()}


def _require_little_endian(path: Path) -> None:
    if sys.byteorder != "little":  # the format is little-endian; torch tensors are in host order
        raise TensorFileError(f"{path}: safetensors are read and written on little-endian hosts only")


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, *,
              metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` atomically (a temporary file, fsync, rename); returns the file's size.

    Largest element size first, then by name (as the reference writer orders them), after a header
    space-padded to a multiple of 8, so every tensor's bytes start aligned to its element size.
    Non-contiguous tensors are written in C order; any device."""
    path = Path(path)
    _require_little_endian(path)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TensorFileError(f"{path}: metadata must map strings to strings, got {key!r}: {value!r}")
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise TensorFileError(f"{path}: {name!r} cannot name a tensor")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_NAMES:
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TensorFileError(f"{path}: tensor {name!r} is a {kind}, which safetensors cannot hold "
                                  f"(it holds {', '.join(str(d) for d in DTYPE_NAMES)})")
    order = sorted(tensors, key=lambda name: (-tensors[name].dtype.itemsize, name))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with _atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        buffer = bytearray(min(_CHUNK, max(offset, 1)))
        staging = torch.frombuffer(buffer, dtype=torch.uint8)
        for name in order:
            _write_tensor(f, tensors[name], buffer, staging)
    return 8 + len(raw) + offset


def _write_tensor(f, tensor: torch.Tensor, buffer: bytearray, staging: torch.Tensor) -> None:
    """The tensor's C-order bytes, through ``buffer`` a chunk at a time (no numpy, no full copy)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = flat.view(torch.uint8)  # (numel * itemsize,) host order = little-endian
    for start in range(0, data.numel(), len(buffer)):
        piece = data[start:start + len(buffer)]
        staging[:piece.numel()].copy_(piece)
        f.write(memoryview(buffer)[:piece.numel()])


def shard_name(index: int, count: int) -> str:
    """Hugging Face's shard names: 1-based, five digits (``model-00001-of-00003.safetensors``)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards of at most ``max_shard_bytes`` of tensor data, greedily in the
    given order, as huggingface_hub's ``split_torch_state_dict_into_shards`` does: a tensor larger
    than the limit gets a shard of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class ShardedWrite:
    files: tuple[str, ...]  # weight files written in the folder (and the index when sharded)
    weight_map: dict[str, str]  # tensor name -> file
    total_size: int  # bytes of tensor data, the index's metadata.total_size


def save_sharded(tensors: Mapping[str, torch.Tensor], folder: str | os.PathLike, *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 metadata: Mapping[str, str] | None = None) -> ShardedWrite:
    """``model.safetensors`` if the tensors fit ``max_shard_bytes``, else shards plus the index; each file
    atomically, the index after its shards, then weight files of an earlier write that would shadow
    or outlive these (a stale ``model.safetensors`` is read before an index) are removed."""
    folder = Path(folder)
    sizes = {name: t.numel() * t.dtype.itemsize for name, t in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    weight_map = {}
    for file, members in zip(names, shards):
        save_file({name: tensors[name] for name in members}, folder / file, metadata=metadata)
        weight_map.update(dict.fromkeys(members, file))
    total = sum(sizes.values())
    written = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(folder / INDEX_FILE, index)
        written.append(INDEX_FILE)
    for stale in folder.iterdir():
        if stale.name not in written and (stale.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(stale.name)):
            stale.unlink()
    return ShardedWrite(files=tuple(written), weight_map=weight_map, total_size=total)


def write_json(path: Path, value: object) -> None:
    """Hugging Face's JSON layout (indent 2, sorted keys, final newline), atomically."""
    write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, atomically (runtime/atomic.py)."""
    with _atomic_file(path) as f:
        f.write(data)


@contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """runtime/atomic.py's ``atomic_file``, its error a TensorFileError (an ``error:`` line, exit 2)."""
    try:
        with atomic_file(path) as f:
            yield f
    except AtomicWriteError as e:
        raise TensorFileError(str(e)) from None
