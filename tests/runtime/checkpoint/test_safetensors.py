"""safetensors files: our reader against files written from the spec in tests/hf_reference.py, our writer
against its parser, round trips, every header check, and that reading one tensor reads only its pages."""

from __future__ import annotations

import gc
import json
import math
import struct
from pathlib import Path

import pytest
import torch

import runtime.checkpoint.safetensors as safetensors_module
from runtime.checkpoint.files import CheckpointError
from runtime.checkpoint.safetensors import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsReader,
    TensorFileError,
    load_file,
    plan_shards,
    read_header,
    save_file,
    save_sharded,
    write_bytes,
)
from tests import hf_reference as ref

# The format's dtype names -> torch's, written out here rather than taken from the module under test.
TORCH_DTYPE = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
               "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
               "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
               "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPE["F8_E8M0"] = torch.float8_e8m0fnu

# name -> (dtype, shape, values in C order, the values torch should show); 8-bit floats as raw bytes
# whose values follow from their bit layouts (E4M3: bias 7, E5M2: bias 15, E8M0: 2 ** (byte - 127)).
SAMPLES = {
    "flags": ("BOOL", [2, 3], [True, False, True, True, False, False], None),
    "u8": ("U8", [5], [0, 1, 127, 128, 255], None),
    "i8": ("I8", [5], [-128, -1, 0, 1, 127], None),
    "i16": ("I16", [5, 1], [-32768, -2, 0, 3, 32767], None),
    "u16": ("U16", [4], [0, 1, 40000, 65535], None),
    "i32": ("I32", [2, 2], [-2**31, -7, 0, 2**31 - 1], None),
    "u32": ("U32", [4], [0, 1, 3_000_000_000, 2**32 - 1], None),
    "i64": ("I64", [4], [-2**63, -9, 0, 2**63 - 1], None),
    "u64": ("U64", [4], [0, 1, 2**63 + 5, 2**64 - 1], None),
    "half": ("F16", [5], [0.5, -2.0, 65504.0, 2.0**-24, -0.0], None),
    "brain": ("BF16", [2, 2], [1.0, -3.5, 2.0**100, -0.0], None),
    "single": ("F32", [3], [1.5, -0.0, float("inf")], None),
    "double": ("F64", [3], [math.pi, -1e300, 5e-324], None),
    "e4m3": ("F8_E4M3", [5], [0x38, 0xB8, 0x7E, 0x01, 0x00], [1.0, -1.0, 448.0, 2.0**-9, 0.0]),
    "e5m2": ("F8_E5M2", [5], [0x3C, 0xC0, 0x7B, 0x01, 0x7C], [1.0, -2.0, 57344.0, 2.0**-16, float("inf")]),
    "e8m0": ("F8_E8M0", [4], [0x7F, 0x80, 0x00, 0xFE], [1.0, 2.0, 2.0**-127, 2.0**127]),
    "complex": ("C64", [3], [1 + 2j, -0.5 - 0j, 3j], None),
    "scalar": ("F32", [], [2.5], None),
    "empty": ("F16", [0], [], None),
    "empty_3d": ("I64", [2, 0, 3], [], None),
}
SAMPLES = {name: s for name, s in SAMPLES.items() if s[0] in TORCH_DTYPE}


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def sample_files() -> dict[str, tuple[str, list[int], bytes]]:
    return {name: (dtype, shape, ref.pack(dtype, values)) for name, (dtype, shape, values, _) in SAMPLES.items()}


def check_sample(name: str, t: torch.Tensor) -> None:
    dtype, shape, values, shown = SAMPLES[name]
    assert t.dtype == TORCH_DTYPE[dtype] and list(t.shape) == shape, name
    assert raw_bytes(t) == ref.pack(dtype, values), name
    if dtype.startswith("F8_"):
        assert t.float().reshape(-1).tolist() == shown, name
    elif dtype not in ("U64",):  # torch shows uint64 above 2**63 as negative ints on some versions
        assert t.reshape(-1).tolist() == values, name


LAYOUTS = {
    "aligned": dict(spaces=None),
    # data starting at an odd offset (so every tensor is misaligned), keys in reverse order, metadata
    "odd": dict(spaces=3, order=list(reversed(SAMPLES)), metadata={"format": "pt", "note": "é"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reads_reference_files_bit_exact(tmp_path, layout):
    path = tmp_path / "ref.safetensors"
    ref.write_safetensors(path, sample_files(), **LAYOUTS[layout])
    reader = SafetensorsReader.open(path)
    assert sorted(reader.names()) == sorted(SAMPLES)
    assert reader.metadata == LAYOUTS[layout].get("metadata", {})
    for name in SAMPLES:
        entry = reader.entry(name)
        assert (entry.dtype, list(entry.shape)) == (TORCH_DTYPE[SAMPLES[name][0]], SAMPLES[name][1])
        check_sample(name, reader.read(name))
    assert set(load_file(path)) == set(SAMPLES)


def test_a_read_tensor_is_private_and_leaves_the_file_alone(tmp_path):
    path = tmp_path / "ref.safetensors"
    ref.write_safetensors(path, sample_files())
    before = path.read_bytes()
    reader = SafetensorsReader.open(path)
    reader.read("single").add_(1.0)  # copy-on-write: another read and the file still hold the original
    check_sample("single", reader.read("single"))
    assert path.read_bytes() == before


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous (every other element of a wider buffer)."""
    wide = torch.empty(*t.shape, 2, dtype=t.dtype).select(-1, 0)
    return wide.copy_(t)


def test_writer_files_follow_the_format(tmp_path):
    tensors = {name: torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPE[dtype]).reshape(shape) if raw
               else torch.empty(shape, dtype=TORCH_DTYPE[dtype]) for name, (dtype, shape, raw) in sample_files().items()}
    tensors = {name: strided(t) if t.numel() > 1 else t for name, t in tensors.items()}
    assert not tensors["i32"].is_contiguous()
    path = tmp_path / "ours.safetensors"
    size = save_file(tensors, path, metadata={"format": "pt"})
    assert size == path.stat().st_size
    n, metadata, parsed = ref.parse_safetensors(path)
    assert metadata == {"format": "pt"}
    assert n % 8 == 0, "the data must start 8-byte aligned"
    text = path.read_bytes()[8:8 + n]
    assert text.rstrip(b" ").endswith(b"}") and json.loads(text) is not None  # padded with spaces only
    assert parsed == sample_files()
    header = json.loads(text)
    for name, (dtype, _, _) in parsed.items():  # each tensor aligned to its element size
        assert (8 + n + header[name]["data_offsets"][0]) % ref.ITEMSIZE[dtype] == 0, name
    assert [p.name for p in tmp_path.iterdir()] == ["ours.safetensors"]  # no temporary left behind


@pytest.mark.parametrize("what", ["tensors", "bytes"])
def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, what):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the previous file")

    def interrupted(fd):  # Ctrl-C (or SIGTERM's handler) after the bytes, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_module.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_file({"x": torch.ones(3)}, path) if what == "tensors" else write_bytes(path, b"new")
    assert path.read_bytes() == b"the previous file"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_round_trip_random_tensors_of_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in TORCH_DTYPE.values():
        raw = torch.randint(0, 256, (3 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw = raw % 2
        tensors[str(dtype)] = raw.view(dtype).reshape(3, 5)
    tensors["transposed"] = torch.randn(4, 6, generator=g).t()
    save_file(tensors, tmp_path / "x.safetensors")
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert raw_bytes(back[name]) == raw_bytes(t), name


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(NotImplementedError):  # a meta tensor has no bytes to copy out
        save_file({"a": torch.zeros(3), "b": torch.empty(3, device="meta")}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def _raw(path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _truncated_data(path: Path) -> Path:
    ref.write_safetensors(path, {"w1": ("F32", [2], ref.pack("F32", [1.0, 2.0])),
                                 "w2": ("F32", [4], ref.pack("F32", [3.0] * 4))})
    path.write_bytes(path.read_bytes()[:-3])
    return path


BAD_FILES = {  # case -> (make the file, words the message must hold besides the file's name)
    "too short": (lambda p: p.write_bytes(b"\x05\x00") and p, ["truncated"]),
    "truncated header": (lambda p: _raw(p, b'{"a":', length=1000), ["truncated", "1000"]),
    "truncated data": (_truncated_data, ["truncated", "'w2'"]),
    "sub-byte dtype": (lambda p: _raw(p, {"w": _entry("F4", [2], 0, 1)}, b"\0"), ["'w'", "'F4'"]),
    "unknown dtype": (lambda p: _raw(p, {"w": _entry("Q7", [2], 0, 2)}, b"\0\0"), ["'w'", "'Q7'"]),
    "size mismatch": (lambda p: _raw(p, {"w": _entry("F32", [2], 0, 4)}, b"\0" * 4), ["'w'", "needs 8 bytes"]),
    "overlap": (lambda p: _raw(p, {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, b"\0" * 12),
                ["'a'", "'b'", "overlaps"]),
    "hole": (lambda p: _raw(p, {"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, b"\0" * 12),
             ["'b'", "belong to no tensor"]),
    "trailing bytes": (lambda p: _raw(p, {"a": _entry("U8", [1], 0, 1)}, b"\0\0"), ["1 byte after the last tensor"]),
    "listed twice": (lambda p: _raw(p, b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                       b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0\0"), ["'a'", "twice"]),
    "not json": (lambda p: _raw(p, b"{nope", b""), ["not valid JSON"]),
    "not utf-8": (lambda p: _raw(p, b'{"\xff":1}', b""), ["UTF-8"]),
    "not an object": (lambda p: _raw(p, b"[1, 2]", b""), ["list"]),
    "huge header": (lambda p: _raw(p, b"{}", length=2**40), ["exceeds"]),
    "bad metadata": (lambda p: _raw(p, {"__metadata__": {"k": 1}}, b""), ["__metadata__"]),
    "no offsets": (lambda p: _raw(p, {"w": {"dtype": "U8", "shape": [1]}}, b"\0"), ["'w'", "data_offsets"]),
    "bad shape": (lambda p: _raw(p, {"w": _entry("U8", [True, -1], 0, 0)}, b""), ["'w'", "shape"]),
    "reversed offsets": (lambda p: _raw(p, {"w": _entry("U8", [1], 1, 0)}, b"\0"), ["'w'", "data_offsets"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_one_clear_error(tmp_path, case):
    make, words = BAD_FILES[case]
    path = make(tmp_path / "bad.safetensors")
    with pytest.raises(TensorFileError) as caught:
        read_header(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message, (case, message)
    assert isinstance(caught.value, CheckpointError)


def test_reading_or_writing_what_the_format_cannot_hold_names_the_tensor(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(2)}, path)
    with pytest.raises(TensorFileError, match=r"x\.safetensors: no tensor 'b'"):
        SafetensorsReader.open(path).read("b")
    with pytest.raises(TensorFileError, match=r"tensor 'z' is a torch\.complex128"):
        save_file({"z": torch.zeros(2, dtype=torch.complex128)}, path)
    with pytest.raises(TensorFileError, match="'__metadata__' cannot name a tensor"):
        save_file({"__metadata__": torch.zeros(2)}, path)
    with pytest.raises(TensorFileError, match="metadata must map strings to strings"):
        save_file({"a": torch.zeros(2)}, path, metadata={"step": 3})


def test_plan_shards_is_greedy_and_gives_an_oversized_tensor_its_own_shard():
    sizes = {"a": 40, "b": 50, "c": 20, "huge": 500, "d": 30, "e": 100}
    assert plan_shards(sizes, 100) == [["a", "b"], ["huge"], ["c", "d"], ["e"]]
    assert plan_shards(sizes, 10_000) == [list(sizes)]
    assert plan_shards({}, 100) == [[]]


@pytest.mark.parametrize("limit", [10_000, 600])
def test_sharded_write_matches_hugging_face_layout(tmp_path, limit):
    g = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.w": torch.randn(10, 10, generator=g) for i in range(5)}  # 400 bytes each
    tensors["bias"] = torch.arange(7, dtype=torch.int16)
    written = save_sharded(tensors, tmp_path, max_shard_bytes=limit)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert written.total_size == total
    if limit >= total:
        assert written.files == (SINGLE_FILE,) and not (tmp_path / INDEX_FILE).exists()
        shards = {SINGLE_FILE: ref.parse_safetensors(tmp_path / SINGLE_FILE)[2]}
    else:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(tensors)
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        assert len(files) > 1 and not (tmp_path / SINGLE_FILE).exists()
        shards = {f: ref.parse_safetensors(tmp_path / f)[2] for f in files}
        for f, held in shards.items():
            assert sum(len(raw) for _, _, raw in held.values()) <= limit, f
            assert {n for n, file in index["weight_map"].items() if file == f} == set(held)
    found = {name: raw for held in shards.values() for name, (_, _, raw) in held.items()}
    assert found == {name: raw_bytes(t) for name, t in tensors.items()}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_reading_one_tensor_reads_only_its_pages(tmp_path):
    """A 200 MB file: opening it, reading its last 1 MB tensor and a 4 MB slice of its big one keeps
    resident memory growth far below the file size (pages of a mapping count once touched)."""
    big, chunk = 200 << 20, 8 << 20
    tail = [float(i % 1000) for i in range(1 << 18)]  # 1 MB of float32
    prefix, _ = ref.header_prefix([("big", "U8", [big], big), ("tail", "F32", [len(tail)], 4 * len(tail))])
    path = tmp_path / "large.safetensors"
    with open(path, "wb") as f:
        f.write(prefix)
        pattern = bytes(range(256)) * (chunk // 256)  # byte i of "big" is i % 256
        for _ in range(big // chunk):
            f.write(pattern)
        f.write(ref.pack("F32", tail))
    del pattern
    gc.collect()
    try:
        before = _rss_bytes()
        reader = SafetensorsReader.open(path)
        tail_t = reader.read("tail")
        tail_sum = float(tail_t.double().sum())  # touches all of it
        piece = reader.read("big").narrow(0, 100 << 20, 4 << 20).clone()
        grown = _rss_bytes() - before
    finally:
        path.unlink()  # pytest keeps recent temporary folders: do not leave 200 MB behind
    assert grown < 48 << 20, f"resident memory grew by {grown / 2**20:.0f} MiB reading 5 MB of a 200 MB file"
    assert tail_sum == sum(tail)
    assert torch.equal(piece.view(-1, 256), torch.arange(256, dtype=torch.uint8).expand(len(piece) // 256, 256))
