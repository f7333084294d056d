"""Sampling without replacement, mixtures by share and positions within documents: the properties the
engine's exact resume on any mesh rests on (batches are pure functions of (seed, step))."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from runtime.engine.data import build_data, replica_rows, restart_at_window
from runtime.engine.data.corpus import positions_after_eod
from runtime.engine.data.sampling import Interleave, derive, epoch_order, permuted
from tests.token_writers import write_megatron, write_nanogpt

T = 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _counting_file(tmp_path, n_windows: int, name: str = "count.bin"):
    """Token i is i: a window's first token tells which window it is (window g starts with g * T)."""
    return write_nanogpt(tmp_path / name, list(range(n_windows * T + 1)), "uint32")


def _batches(path, *, batch: int, seed: int = 5, **kw):
    return build_data(str(path), vocab_size=1 << 20, seq_len=T, global_batch_size=batch, seed=seed,
                      val_fraction=0.1, val_source=kw.pop("val_source", str(path)), token_dtype="uint32", **kw).train


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_seeded_order_is_a_bijection_that_changes_with_the_key(n):
    orders = [[permuted(i, n, derive(seed)) for i in range(n)] for seed in (1, 2)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    if n > 3:
        assert orders[0] != orders[1]


def test_every_window_is_read_once_per_epoch_in_an_order_of_its_own(tmp_path):
    n, batch = 37, 8  # the batch size does not divide the epoch: batches straddle epochs
    data = _batches(_counting_file(tmp_path, n), batch=batch)
    seen = torch.cat([data.rows(step, 0, batch)[:, 0] // T for step in range(math.ceil(3 * n / batch))]).tolist()
    epochs = [seen[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs), "a window missed or repeated within an epoch"
    assert epochs[0] != epochs[1] != epochs[2], "every epoch reshuffles"
    assert data.epochs(10) == [10 * batch / n]


def test_a_batch_is_a_pure_function_of_seed_and_step_and_ranks_read_slices_of_it(tmp_path):
    path = _counting_file(tmp_path, 50)
    data = _batches(path, batch=8)
    steps = list(range(12))
    random.Random(0).shuffle(steps)  # any order of calls, a fresh reader: the same batches
    first = {s: data.rows(s, 0, 8) for s in steps}
    again = _batches(path, batch=8)
    assert all(torch.equal(again.rows(s, 0, 8), first[s]) for s in range(12))
    for dp in (2, 4):
        for s in (0, 7):
            assert torch.equal(torch.cat([data.rows(s, *replica_rows(8, d, dp)) for d in range(dp)]), first[s])
            assert torch.equal(torch.cat([data.positions(s, *replica_rows(8, d, dp)) for d in range(dp)]),
                               data.positions(s, 0, 8))
    assert not torch.equal(_batches(path, batch=8, seed=6).rows(0, 0, 8), first[0])


def test_synthetic_ranks_draw_only_their_rows_and_match_the_full_batch():
    data = build_data("synthetic", vocab_size=97, seq_len=T, global_batch_size=8, seed=3, val_fraction=0.1, eod_token=5)
    full = data.train.rows(4, 0, 8)
    assert torch.equal(torch.cat([data.train.rows(4, *replica_rows(8, d, 4)) for d in range(4)]), full)
    assert torch.equal(data.train.rows(4, 3, 4), full[3:4])  # one row alone is the same row
    assert torch.equal(data.train.positions(4, 0, 8), positions_after_eod(full[:, :-1], 5))
    assert not torch.equal(data.val.rows(4, 0, 8), full)


@pytest.mark.parametrize("weights", [["0.7", "0.3"], ["0.5", "0.3", "0.2"], ["1", "2", "3", "4", "5"]])
def test_mixture_shares_stay_within_one_percent_of_the_weights(tmp_path, weights):
    paths = [_counting_file(tmp_path, 40 + 10 * k, f"s{k}.bin") for k in range(len(weights))]
    spec = ",".join(f"{w}:{p}" for w, p in zip(weights, paths))
    data = build_data(spec, vocab_size=1 << 20, seq_len=T, global_batch_size=10, seed=9, val_fraction=0.1,
                      token_dtype="uint32")
    total = sum(Fraction(w) for w in weights)
    for steps in (1, 7, 100):  # 10, 70 and 1,000 sequences
        for share, w in zip(data.train.shares(steps), weights):
            assert abs(share - Fraction(w) / total) <= (0.01 if steps == 100 else 0.1), (steps, share, w)
    # The shares reported are the sequences actually read: count them from the windows' sources.
    corpora = [c.corpus for c in data.train.components]
    counts = [0] * len(weights)
    for step in range(100):
        for corpus, _ in data.train._windows(step, 0, 10):
            counts[corpora.index(corpus)] += 1
    assert [c / 1000 for c in counts] == data.train.shares(100)
    # Each source still reads its windows without replacement: its first epoch is a permutation.
    first = Interleave([Fraction(w) for w in weights], seed=derive(9, 0x4D49))
    k0 = [j for k, j in (first.assign(p) for p in range(1000)) if k == 0]
    n0 = corpora[0].windows
    assert sorted(epoch_order(j, n0, derive(9, 0)) for j in k0[:n0]) == list(range(n0))


def test_positions_restart_after_each_end_of_document_token(tmp_path):
    EOD = 9
    # documents of 4, 3 and 8 tokens, each ending with EOD (Megatron's convention), then one without
    stream = [1, 2, 3, EOD, 4, 5, EOD, 6, 7, 8, 1, 2, 3, 4, EOD, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6]
    path = write_nanogpt(tmp_path / "docs.bin", stream)
    data = build_data(str(path), vocab_size=16, seq_len=8, global_batch_size=1, seed=0, val_fraction=0.1,
                      val_source=str(path), eod_token=EOD, document_mask=True).train
    corpus = data.components[0].corpus
    # window 0 (tokens 0..7) spans three documents
    assert corpus.positions(0).tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # window 1 (tokens 8..15) starts one token into the third document, then a fourth begins
    assert corpus.positions(1).tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert restart_at_window(corpus.positions(1)[None]).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    # window 2 (tokens 16..23) lies inside the fourth document, which began at token 15
    assert corpus.positions(2).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # A batch gives Megatron's window-relative positions (all < T, as a learned position table needs), or the
    # true offsets on request; window 1 is the only window of the single-row batch at step ``step``.
    step = next(s for s in range(3) if data._windows(s, 0, 1)[0][1] == 1)
    assert data.positions(step, 0, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    assert data.positions(step, 0, 1, from_document_start=True).tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]


def test_megatron_positions_follow_the_document_index(tmp_path):
    # three documents of 5, 0 and 11 tokens; the last split into sentences (several sequences per document)
    documents = [[1] * 5, [], [2] * 11]
    prefix = write_megatron(tmp_path / "m", documents, "int32", sentences_per_document=2)
    data = build_data(str(prefix), vocab_size=16, seq_len=4, global_batch_size=1, seed=0, val_fraction=0.1,
                      val_source=str(prefix), document_mask=True).train
    corpus = data.components[0].corpus
    # tokens 0..4: the first document; 5..15: the third (the empty second adds no boundary)
    assert [corpus.positions(g).tolist() for g in range(corpus.windows)] == [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 5, 6]]


def test_document_mask_needs_to_know_where_documents_end(tmp_path):
    path = write_nanogpt(tmp_path / "x.bin", list(range(100)))
    with pytest.raises(Exception, match="--document-mask needs .*--eod-token"):
        build_data(str(path), vocab_size=128, seq_len=4, global_batch_size=1, seed=0, val_fraction=0.1,
                   document_mask=True)
