"""The start-up note for a GPU run whose LM head runs on unaligned kernels (runtime/observe/alignment.py), and
the rule it shares with the GPU cost model (compiler/planner/devices.py ``rows_aligned``)."""

from __future__ import annotations

import pytest

from compiler.planner.devices import rows_aligned
from runtime.observe.alignment import padded_vocabulary, shard_widths, unaligned_head_note


@pytest.mark.parametrize(("length", "itemsize", "aligned"), [(50257, 2, False), (50264, 2, True), (50260, 2, False),
                                                              (50260, 4, True), (50257, 4, False), (128256, 2, True)])
def test_a_row_is_aligned_when_it_is_a_multiple_of_16_bytes(length, itemsize, aligned):
    assert rows_aligned(length, itemsize) is aligned


@pytest.mark.parametrize(("vocab", "mp", "padded"), [(50257, 1, 50304), (50257, 2, 50304), (50257, 4, 50432),
                                                     (50304, 1, 50304), (32000, 8, 32256)])
def test_the_padded_vocabulary_gives_every_mp_shard_a_multiple_of_64_words(vocab, mp, padded):
    assert padded_vocabulary(vocab, mp) == padded and padded % (64 * mp) == 0 and padded >= vocab


def test_a_gpu_run_with_gpt2s_vocabulary_is_told_how_to_pad_it():
    note = unaligned_head_note(50257, mp=2, itemsize=2, device_type="cuda")
    assert note.startswith("note: ") and "25,129 per mp rank, 25,128 on the last" in note
    assert note.endswith("--vocab-size 50304")


@pytest.mark.parametrize(("vocab", "mp", "itemsize", "device"), [
    (50257, 1, 2, "cpu"),  # the CPU's kernels do not care
    (50304, 1, 2, "cuda"), (128256, 8, 2, "cuda"),  # aligned shards
    (50260, 1, 4, "cuda")])  # fp32 rows need 4 values
def test_no_note_where_the_head_is_aligned_or_on_cpu(vocab, mp, itemsize, device):
    assert unaligned_head_note(vocab, mp=mp, itemsize=itemsize, device_type=device) is None


def test_shards_are_split_as_dtensor_splits_them():
    assert shard_widths(50257, 2) == [25129, 25128] and shard_widths(10, 4) == [3, 3, 3, 1]
    assert shard_widths(4, 8) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_uneven_shards_are_noted_even_when_the_larger_one_is_aligned():
    # 1,031 words over 3 ranks: 344 / 344 / 343; 344 bf16 values are 688 = 43 x 16 bytes, 343 are not
    assert unaligned_head_note(1031, mp=3, itemsize=2, device_type="cuda") is not None
    assert unaligned_head_note(1032, mp=3, itemsize=2, device_type="cuda") is None  # 344 each
