"""Token data: built-in text, user text files through a per-machine cache written once, held-out splits,
replica sharding, byte-vocabulary checks and the mixture syntax."""

from __future__ import annotations

import multiprocessing
from fractions import Fraction

import pytest
import torch

from runtime.engine.data import DataError, build_data, inputs_and_targets, parse_mixture, replica_rows
from runtime.engine.data import text as text_module
from runtime.engine.data.corpus import TokenSpan, hold_out_tail
from runtime.engine.data.text import builtin_tokens, text_files, text_tokens


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_builtin_is_real_english_text(tmp_path):
    file = builtin_tokens(tmp_path)
    tokens = file.map()
    text = bytes(tokens[:200_000].tolist()).decode("utf-8")
    assert len(tokens) > 300_000 and file.dtype == "uint8"
    assert text.count(" the ") > 500  # English, not noise


def test_file_and_folder_are_tokenised_as_utf8_bytes_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("héllo wörld\n")
    (corpus / "b.txt").write_text("second file")
    (corpus / "ignored.bin").write_bytes(b"\xff\xfe")
    cache = tmp_path / "cache"
    tokens = text_tokens(text_files(corpus, flag="--data"), cache).map()
    assert bytes(tokens.tolist()) == "héllo wörld\n".encode() + b"\n" + b"second file"
    assert len(list(cache.glob("*.u8"))) == 1
    single = text_tokens(text_files(corpus / "b.txt", flag="--data"), cache).map()
    assert bytes(single.tolist()) == b"second file"


def _build_text_cache(args) -> str:
    """One rank's start: count the cache writes it makes in ``counter``."""
    files, cache, counter = args
    copy = text_module._copy_checked

    def counted(files, out):
        with open(counter, "a") as f:
            f.write("w")
        copy(files, out)

    text_module._copy_checked = counted
    return str(text_tokens(files, cache).path)


@pytest.mark.slow  # real processes
def test_ranks_starting_together_write_the_text_cache_once(tmp_path):
    text = tmp_path / "big.txt"
    text.write_text("a line of text\n" * 200_000)  # 3 MB
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.map(_build_text_cache, [([text], cache, tmp_path / "writes")] * 3)
    assert (tmp_path / "writes").read_text() == "w", "the cache was written more than once"
    assert len(set(paths)) == 1
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [paths[0].rsplit("/", 1)[1]]
    assert (cache / paths[0].rsplit("/", 1)[1]).read_bytes() == text.read_bytes()


def test_non_utf8_file_is_rejected(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff\xfe")
    with pytest.raises(DataError, match="not UTF-8 .*offset 2"):
        text_tokens([bad], tmp_path / "cache")


def test_the_held_out_tail_cuts_across_files():
    spans = [TokenSpan(name, torch.arange(n), 0, n) for name, n in (("a", 60), ("b", 30), ("c", 10))]
    train, val = hold_out_tail(spans, fraction=0.25, need=5)
    assert [(s.name, s.begin, s.end) for s in train] == [("a", 0, 60), ("b", 0, 15)]
    assert [(s.name, s.begin, s.end) for s in val] == [("b", 15, 30), ("c", 0, 10)]


def test_split_needs_one_sequence_on_each_side(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(DataError, match="fewer than one sequence"):
        build_data(str(short), vocab_size=256, seq_len=64, global_batch_size=8, seed=0, val_fraction=0.1)


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
def test_replicas_read_disjoint_rows_of_one_deterministic_global_batch(source):
    data = build_data(source, vocab_size=256, seq_len=16, global_batch_size=8, seed=7, val_fraction=0.1)
    full = data.train.rows(3, 0, 8)
    shards = [data.train.rows(3, *replica_rows(8, d, 4)) for d in range(4)]
    assert torch.equal(torch.cat(shards), full)
    assert torch.equal(data.train.rows(3, 0, 8), full)  # deterministic
    assert not torch.equal(data.train.rows(4, 0, 8), full)  # a new batch every step
    assert not torch.equal(data.val.rows(3, 0, 8), full)  # validation is held out
    inputs, targets = inputs_and_targets(full)
    assert inputs.shape == targets.shape == (8, 16) and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_byte_text_needs_a_byte_vocabulary():
    with pytest.raises(DataError, match="--vocab-size 100"):
        build_data("builtin", vocab_size=100, seq_len=16, global_batch_size=8, seed=0, val_fraction=0.1)


def test_mixture_syntax():
    assert parse_mixture("a.bin", flag="--data") == [(Fraction(1), "a.bin")]
    assert parse_mixture("0.7:a.bin,0.3:/x/b.bin", flag="--data") == [(Fraction(7, 10), "a.bin"), (Fraction(3, 10), "/x/b.bin")]
    for bad in ("0.7:a.bin,b.bin", "0:a.bin,1:b.bin", "-1:a.bin,2:b.bin"):
        with pytest.raises(DataError, match="WEIGHT:PATH"):
            parse_mixture(bad, flag="--data")
