"""The stacked targets of multi-token prediction (runtime/engine/data/future_tokens.py): the layout, the shifted tokens
and labels, and a context-parallel rank reading its chunks' columns plus D more (``chunked_model_batch``) getting what
cutting the whole rows gives, document rule and end-of-document masking included."""

from __future__ import annotations

import pytest
import torch

from compiler.parallelize.context_parallel import local_chunks
from compiler.parallelize.cross_entropy import IGNORE_INDEX
from runtime.engine.data.future_tokens import FutureTargets
from runtime.engine.data.inputs import (
    ContextSlice,
    chunked_model_batch,
    document_ids,
    model_batch,
    without_loss_across_documents,
)

EOD, T, B = 0, 16, 3


def _rows_and_positions() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 5, (B, T + 1), generator=torch.Generator().manual_seed(0))  # token 0 ends a document
    positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(1, T):
            positions[b, t] = 0 if rows[b, t - 1] == EOD else positions[b, t - 1] + 1
    return rows, positions


class _Columns:
    """A token file's rows read a range of columns at a time, as a context-parallel rank reads them."""

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor):
        self.rows, self.positions, self.reads = rows, positions, []

    def tokens(self, lo: int, hi: int) -> torch.Tensor:
        self.reads.append((lo, hi))
        return self.rows[:, lo:hi + 1]

    def documents(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.positions[:, lo:hi], document_ids(self.positions)[:, lo:hi]


def test_the_layout_holds_labels_inputs_and_the_models_other_inputs():
    rows, positions = _rows_and_positions()
    (tokens, pos, docs), target = model_batch(rows, positions, mtp_depth=2)
    assert target.shape == (B, T, 2 * 2 + 1 + 2)
    parts = FutureTargets.of(target, 2)
    assert torch.equal(parts.labels[..., 0], rows[:, 1:]) and torch.equal(parts.extras[0], pos)
    assert torch.equal(parts.extras[1], docs)
    for k in (1, 2):
        assert torch.equal(parts.future[:, :T - k, k - 1], tokens[:, k:])  # t_{i+k}
        assert (parts.future[:, T - k:, k - 1] == 0).all() and (parts.labels[:, T - k:, k] == IGNORE_INDEX).all()
        same = docs[:, k:] == docs[:, :T - k]  # t_{i+k} in t_i's document: its label t_{i+k+1}, else none
        want = torch.where(same, rows[:, k + 1:], IGNORE_INDEX)
        assert torch.equal(parts.labels[:, :T - k, k], want)
    assert (parts.labels[..., 1] == IGNORE_INDEX).any()  # the rows do cross documents


def test_without_documents_every_shifted_label_is_kept_and_no_extras():
    rows, _ = _rows_and_positions()
    tokens, target = model_batch(rows, None, mtp_depth=1)
    parts = FutureTargets.of(target, 1)
    assert target.shape == (B, T, 3) and parts.extras == ()
    assert torch.equal(parts.labels[:, :T - 1, 1], rows[:, 2:]) and torch.equal(parts.future[:, :T - 1, 0], tokens[:, 1:])


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_context_parallel_rank_reads_d_more_columns_and_gets_the_whole_rows_cut(depth, document_mask, cp):
    rows, positions = _rows_and_positions()
    length = T // (2 * cp)
    for rank in range(cp):
        context = ContextSlice(rank, cp)
        want_inputs, want = model_batch(rows, positions if document_mask else None, context=context, mtp_depth=depth)
        columns = _Columns(rows, positions)
        got_inputs, got = chunked_model_batch(columns, seq_len=T, document_mask=document_mask, context=context,
                                              mtp_depth=depth)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_inputs, want_inputs))
        for (lo, hi), chunk in zip(columns.reads, (rank, 2 * cp - 1 - rank)):
            assert (lo, hi) == (chunk * length, min((chunk + 1) * length + depth, T))  # its chunk and D more columns
        masked = without_loss_across_documents(got_inputs, got, EOD, mtp_depth=depth)
        whole_inputs, whole = model_batch(rows, positions if document_mask else None, mtp_depth=depth)
        whole = without_loss_across_documents(whole_inputs, whole, EOD, mtp_depth=depth)
        columns = 2 * depth + 1  # labels and the depths' inputs (the positions a rank gets are its own)
        assert torch.equal(masked[..., :columns], local_chunks(whole, rank=rank, cp=cp)[..., :columns])


def test_after_an_end_of_document_no_depth_has_a_label():
    rows, positions = _rows_and_positions()
    inputs, target = model_batch(rows, None, mtp_depth=2)
    parts = FutureTargets.of(without_loss_across_documents(inputs, target, EOD, mtp_depth=2), 2)
    assert (parts.labels[..., 0][inputs == EOD] == IGNORE_INDEX).all()
    for k in (1, 2):
        assert (parts.labels[..., k][parts.future[..., k - 1] == EOD] == IGNORE_INDEX).all()
        kept = parts.future[..., k - 1] != EOD
        assert torch.equal(parts.labels[..., k][kept], FutureTargets.of(target, 2).labels[..., k][kept])
