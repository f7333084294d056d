"""The loss-mask file format (runtime/engine/data/loss_mask.py): a byte per token, bit 0 trained, bit 1 a
conversation's first token; conversations and their trained counts read back (also across the read's chunks and
from the cache); malformed masks are one error naming the file and the byte."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.data import DataError
from runtime.engine.data import loss_mask as loss_mask_module
from runtime.engine.data.loss_mask import conversations, mask_byte, mask_path


def _mask(tmp_path, values: list[int]):
    path = tmp_path / "train.mask"
    path.write_bytes(bytes(values))
    return path


def test_the_mask_lies_beside_its_token_file(tmp_path):
    assert mask_path(tmp_path / "train.bin") == tmp_path / "train.mask"
    assert mask_path(tmp_path / "corpus_text_document.bin").name == "corpus_text_document.mask"
    assert [mask_byte(trained=t, starts=s) for s in (False, True) for t in (False, True)] == [0, 1, 2, 3]


@pytest.mark.parametrize("chunk", [3, 1 << 22])
@pytest.mark.parametrize("cached", [False, True])
def test_conversations_and_their_trained_tokens(tmp_path, monkeypatch, chunk, cached):
    monkeypatch.setattr(loss_mask_module, "CHUNK_BYTES", chunk)  # conversations and trained runs across chunks
    # three conversations: 5 tokens (2 trained), 2 tokens (none), 6 tokens (3 trained, the first one too)
    values = [2, 0, 1, 1, 0, 2, 0, 3, 0, 1, 1, 0, 0]
    path = _mask(tmp_path, values)
    cache = tmp_path / "cache" if cached else None
    for _ in range(2):  # the second read comes from the cache when there is one
        found = conversations(path, count=len(values), flag="--data", cache_dir=cache)
        assert found.starts.tolist() == [0, 5, 7]
        assert found.lengths.tolist() == [5, 2, 6]
        assert found.trained.tolist() == [2, 0, 3]
    assert bool(cache and list(cache.glob("mask-*.trained"))) == cached


@pytest.mark.parametrize("values, count, message", [
    ([2, 1, 4, 0], 4, r"train.mask: byte 2 is 4, not a mask value \(0-3"),
    ([0, 1, 2, 0], 4, r"train.mask: the first token does not start a conversation"),
    ([2, 1, 1], 4, r"train.mask: 3 bytes, but its token file holds 4 tokens"),
])
def test_malformed_masks_are_one_error_naming_the_file(tmp_path, values, count, message):
    with pytest.raises(DataError, match=message):
        conversations(_mask(tmp_path, values), count=count, flag="--data", cache_dir=None)


def test_an_empty_mask_has_no_conversations(tmp_path):
    found = conversations(_mask(tmp_path, []), count=0, flag="--data", cache_dir=None)
    assert len(found) == 0 and found.trained.dtype == torch.int64
