"""Token data: built-in text, user files with a cache, seeded synthetic tokens, replica sharding."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.data import (
    DataError,
    build_data,
    inputs_and_targets,
    load_text_tokens,
    replica_rows,
    split_tokens,
)


def test_builtin_is_real_english_text():
    tokens, description = load_text_tokens("builtin")
    text = bytes(tokens[:200_000].tolist()).decode("utf-8")
    assert len(tokens) > 300_000 and "pydoc_data" in description
    assert text.count(" the ") > 500  # English, not noise


def test_file_and_folder_are_tokenised_as_utf8_bytes_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("héllo wörld\n")
    (corpus / "b.txt").write_text("second file")
    (corpus / "ignored.bin").write_bytes(b"\xff\xfe")
    cache = tmp_path / "cache"
    tokens, _ = load_text_tokens(str(corpus), cache_dir=cache)
    assert bytes(tokens.tolist()) == "héllo wörld\n".encode() + b"\n" + b"second file"
    assert len(list(cache.iterdir())) == 1
    single, _ = load_text_tokens(str(corpus / "b.txt"), cache_dir=cache)
    assert bytes(single.tolist()) == b"second file"


def test_non_utf8_file_is_rejected(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff\xfe")
    with pytest.raises(DataError, match="not UTF-8"):
        load_text_tokens(str(bad), cache_dir=tmp_path / "cache")


def test_split_needs_one_sequence_on_each_side():
    with pytest.raises(DataError, match="fewer than one sequence"):
        split_tokens(torch.zeros(100, dtype=torch.uint8), val_fraction=0.1, seq_len=64, description="", source="x")
    splits = split_tokens(torch.arange(1000) % 256, val_fraction=0.1, seq_len=64, description="", source="x")
    assert len(splits.train) == 900 and len(splits.val) == 100


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
