"""Token files: nanoGPT, llm.c and Megatron files written from their specifications (tests/token_writers.py)
read back window for window; validation splits; and one-line errors for bad magic, version, size or tokens."""

from __future__ import annotations

import random
import struct

import pytest

from runtime.engine.data import DataError, build_data
from runtime.engine.data import token_files as token_files_module
from tests.launches.test_bad_input import TINY, error_line
from tests.token_writers import STRUCT, write_llmc, write_megatron, write_nanogpt

T = 8


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _tokens(n: int, high: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(n)]


def _data(path, *, vocab=50257, **kw):
    return build_data(str(path), vocab_size=vocab, seq_len=T, global_batch_size=4, seed=1,
                      val_fraction=kw.pop("val_fraction", 0.25), **kw)


def _all_windows(batches) -> list[list[int]]:
    corpus = batches.components[0].corpus
    return [corpus.window(g).tolist() for g in range(corpus.windows)]


def _expected_windows(tokens: list[int]) -> list[list[int]]:
    return [tokens[w * T: w * T + T + 1] for w in range((len(tokens) - 1) // T)]


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32"])
def test_nanogpt_bin_round_trips_with_its_token_dtype(tmp_path, dtype):
    tokens = _tokens(400, 50257)
    write_nanogpt(tmp_path / "train.bin", tokens, dtype)
    data = _data(tmp_path / "train.bin", token_dtype=dtype)
    train, val = _all_windows(data.train), _all_windows(data.val)
    cut = 300  # 25% held out
    assert train == _expected_windows(tokens[:cut]) and val == _expected_windows(tokens[cut:])
    assert "nanoGPT" in data.description and not data.byte_level


def test_nanogpt_val_bin_beside_train_bin_is_the_validation_set(tmp_path):
    train, val = _tokens(200, 1000, 1), _tokens(100, 1000, 2)
    write_nanogpt(tmp_path / "train.bin", train)
    write_nanogpt(tmp_path / "val.bin", val)
    for given in (tmp_path / "train.bin", tmp_path):  # the file, or its folder
        data = _data(given, vocab=1000)
        assert _all_windows(data.train) == _expected_windows(train)
        assert _all_windows(data.val) == _expected_windows(val)


def test_a_uint16_file_whose_bytes_are_utf8_is_read_as_tokens_not_text(tmp_path):
    tokens = [0x6968, 0x2121] * 50  # the bytes "hi!!": valid UTF-8 (and ASCII)
    path = write_nanogpt(tmp_path / "tokens.bin", tokens)
    (tmp_path / "tokens.bin").read_bytes().decode("utf-8")  # the trap the issue describes
    data = _data(path)
    assert _all_windows(data.train)[0] == tokens[:T + 1] and not data.byte_level
    # The same bytes under a name that says neither text nor tokens: an error naming the flag to set.
    other = tmp_path / "tokens.dat"
    other.write_bytes(path.read_bytes())
    with pytest.raises(DataError, match="--data-format"):
        _data(other)
    assert _data(other, data_format="nanogpt").byte_level is False
    assert _data(other, data_format="text", vocab=256).byte_level is True


@pytest.mark.parametrize("version,high", [(1, 50257), (7, 128256)])
def test_llmc_shards_round_trip_in_both_versions(tmp_path, version, high):
    shards = [_tokens(100 + 10 * i, high, i) for i in range(3)]
    for i, tokens in enumerate(shards[:2]):
        write_llmc(tmp_path / f"fineweb_train_{i:06d}.bin", tokens, version=version)
    write_llmc(tmp_path / "fineweb_val_000000.bin", shards[2], version=version)
    expected_train = _expected_windows(shards[0]) + _expected_windows(shards[1])  # windows never cross shards
    for given in (tmp_path, tmp_path / "fineweb_*.bin"):  # a folder, a glob
        data = _data(given, vocab=high)
        assert _all_windows(data.train) == expected_train
        assert _all_windows(data.val) == _expected_windows(shards[2])
    # One shard: its _val_ siblings validate.
    one = _data(tmp_path / "fineweb_train_000001.bin", vocab=high)
    assert _all_windows(one.train) == _expected_windows(shards[1])
    assert _all_windows(one.val) == _expected_windows(shards[2])


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64", "uint16"])
def test_megatron_pair_round_trips_for_every_integer_dtype_code(tmp_path, dtype):
    high = min(1000, 1 << (8 * STRUCT[dtype][1] - 1))
    documents = [_tokens(n, high, n) for n in (50, 7, 120, 33)]
    prefix = write_megatron(tmp_path / "corpus_text_document", documents, dtype)
    stream = [t for doc in documents for t in doc]
    for given in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        data = _data(given, vocab=high, val_fraction=0.2)
        cut = len(stream) - int(len(stream) * 0.2)
        assert _all_windows(data.train) == _expected_windows(stream[:cut])
        assert _all_windows(data.val) == _expected_windows(stream[cut:])
        assert "Megatron" in data.description


def test_val_data_names_a_validation_set_of_any_kind(tmp_path):
    train, val = _tokens(200, 1000, 1), _tokens(120, 1000, 2)
    write_nanogpt(tmp_path / "a.bin", train)
    write_megatron(tmp_path / "held", [val], "uint16")
    data = _data(tmp_path / "a.bin", vocab=1000, val_source=str(tmp_path / "held"))
    assert _all_windows(data.train) == _expected_windows(train)  # nothing held out of --data
    assert _all_windows(data.val) == _expected_windows(val)


def test_the_vocabulary_scan_reads_in_chunks_and_names_the_first_offending_token(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files_module, "CHUNK_BYTES", 64)  # 32 uint16 tokens a chunk: 10 chunks
    tokens = _tokens(320, 100)
    tokens[77], tokens[250], tokens[251] = 150, 65535, 65535  # the largest lies in a later chunk
    path = write_nanogpt(tmp_path / "x.bin", tokens)
    with pytest.raises(DataError) as raised:
        _data(path, vocab=100)
    message = str(raised.value)
    assert f"--data {path}: token 65,535 at token offset 250 (byte 500)" in message
    assert "--vocab-size 65,536 or more" in message and "--token-dtype" in message
    assert len(_all_windows(_data(path, vocab=65536).train)) == (240 - 1) // T  # every token fits: accepted
    # The scan is cached per machine: one summary per file version and dtype.
    cache = tmp_path / "cache" / "hybrid_engine" / "tokens"
    assert len(list(cache.glob("scan-*.json"))) == 1


def _bad_llmc(tmp_path, fix) -> str:
    path = write_llmc(tmp_path / "web_train_000000.bin", _tokens(100, 1000))
    raw = bytearray(path.read_bytes())
    fix(raw)
    path.write_bytes(bytes(raw))
    return str(path)


@pytest.mark.parametrize("case,fix,words", [
    ("bad-magic", lambda raw: raw.__setitem__(slice(0, 4), struct.pack("<i", 12345)),
     ["bad llm.c magic 12345 at byte 0", "20240520", "--data-format nanogpt"]),
    ("bad-version", lambda raw: raw.__setitem__(slice(4, 8), struct.pack("<i", 2)),
     ["magic 20240520 needs version 1", "byte 4 says 2"]),
    ("truncated", lambda raw: raw.__delitem__(slice(-10, None)),
     ["says 100 uint16 tokens", "1,224 bytes", "1,214 bytes (truncated)"]),
])
def test_bad_llmc_shards_get_one_line_naming_file_and_field(tmp_path, case, fix, words):
    path = _bad_llmc(tmp_path, fix)
    line = error_line(1, [*TINY, "--vocab-size", "1000", "--seq-len", "8", "--data", path])
    assert f"--data {path}:" in line, line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_a_token_beyond_the_vocabulary_is_one_line_for_every_format(tmp_path):
    tokens = _tokens(200, 500)
    tokens[123] = 700
    cases = {
        "nanogpt": str(write_nanogpt(tmp_path / "n.bin", tokens)),
        "llmc": str(write_llmc(tmp_path / "l_train_000000.bin", tokens, version=7)),
        "megatron": str(write_megatron(tmp_path / "m", [tokens[:100], tokens[100:]], "int32")),
    }
    for fmt, path in cases.items():
        line = error_line(1, [*TINY, "--vocab-size", "600", "--seq-len", "8", "--data", path])
        assert "token 700 at token offset 123" in line and "--vocab-size 701 or more" in line, (fmt, line)
        assert ("--token-dtype" in line) == (fmt == "nanogpt"), line  # only a headerless file's dtype is a guess


def _bad_megatron(tmp_path, fix_idx=None, fix_bin=None) -> str:
    prefix = write_megatron(tmp_path / "m", [_tokens(40, 500, 1), _tokens(60, 500, 2)], "uint16")
    for suffix, fix in ((".idx", fix_idx), (".bin", fix_bin)):
        if fix:
            path = tmp_path / f"m{suffix}"
            raw = bytearray(path.read_bytes())
            fix(raw)
            path.write_bytes(bytes(raw))
    return str(prefix)


@pytest.mark.parametrize("case,fixes,words", [
    ("bad-magic", {"fix_idx": lambda raw: raw.__setitem__(slice(0, 4), b"NOPE")}, ["bad magic", "MMIDIDX"]),
    ("bad-version", {"fix_idx": lambda raw: raw.__setitem__(slice(9, 17), struct.pack("<Q", 2))}, ["version 2 at byte 9"]),
    ("float-tokens", {"fix_idx": lambda raw: raw.__setitem__(17, 7)}, ["dtype code 7", "float32 tokens are not token ids"]),
    ("truncated-idx", {"fix_idx": lambda raw: raw.__delitem__(slice(-8, None))}, ["truncated or corrupt"]),
    ("truncated-bin", {"fix_bin": lambda raw: raw.__delitem__(slice(-6, None))}, ["byte 200", "194 bytes (truncated)"]),
])
def test_bad_megatron_pairs_get_one_line_naming_file_and_field(tmp_path, case, fixes, words):
    prefix = _bad_megatron(tmp_path, **fixes)
    line = error_line(1, [*TINY, "--vocab-size", "600", "--seq-len", "8", "--data", prefix])
    assert "--data" in line and str(tmp_path / "m") in line, line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_a_nanogpt_file_of_odd_size_and_a_missing_file_are_one_line(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 20 + b"\x01")
    line = error_line(1, [*TINY, "--seq-len", "8", "--data", str(odd)])
    assert "41 bytes is not a whole number of uint16 tokens" in line and "--token-dtype" in line, line
    line = error_line(1, [*TINY, "--seq-len", "8", "--val-data", str(tmp_path / "nowhere.bin")])
    assert f"--val-data {tmp_path / 'nowhere.bin'}: no such file" in line, line
