"""A context-parallel rank reads only its own chunks of each window (runtime/engine/data/inputs.py
``chunked_model_batch``, ``Corpus.columns``): its tensors must equal what cutting whole rows gives
(``model_batch(..., context=...)``) exactly, document ids counted over the whole window included, while it copies
only its chunks' T/cp + 2 tokens of each row."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from compiler.parallelize.context_parallel import local_chunks
from compiler.parallelize.cross_entropy import IGNORE_INDEX
from runtime.engine.data import build_data
from runtime.engine.data.batches import CorpusBatches
from runtime.engine.data.corpus import Corpus, restart_at_window
from runtime.engine.data.inputs import ContextSlice, document_ids, model_batch, rank_batch, without_loss_across_documents
from runtime.engine.evaluation import window_batch
from tests.token_writers import write_megatron, write_nanogpt

T = 24  # cuts into 2·cp equal chunks for every cp in 1..4
B = 8
EOD = 0
CONTEXTS = [ContextSlice(rank, cp) for cp in range(1, 5) for rank in range(cp)]
# (how documents are marked, --document-mask)
CORPORA = [("eod", True), ("eod", False), ("megatron", True), ("none", False)]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class CountingTokens:
    """A span's memory-mapped tokens that note how many tokens each read copies out."""

    def __init__(self, tokens: torch.Tensor, reads: list[int]):
        self.tokens, self.reads = tokens, reads

    def __getitem__(self, index: slice) -> torch.Tensor:
        part = self.tokens[index]
        self.reads.append(len(part))
        return part


def _documents(seed: int = 0) -> list[list[int]]:
    """Documents of 1 to 60 tokens (some shorter than a chunk, some longer than a window), and an empty one."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 100) for _ in range(rng.randint(1, 60))] for _ in range(50)]
    return docs[:7] + [[]] + docs[7:]


def _data(tmp_path, kind: str, document_mask: bool):
    docs = _documents()
    if kind == "megatron":  # documents from Megatron's index, several sequences each
        path = write_megatron(tmp_path / "m", docs, sentences_per_document=2)
    else:  # documents ended by EOD, or no document information at all
        path = write_nanogpt(tmp_path / "docs.bin", [t for d in docs for t in ([*d, EOD] if d else [])])
    return build_data(str(path), vocab_size=128, seq_len=T, global_batch_size=B, seed=3, val_fraction=0.25,
                      eod_token=EOD if kind == "eod" else None, document_mask=document_mask)


def _counting(batches: CorpusBatches, reads: list[int]) -> CorpusBatches:
    """The same batches, reading tokens through ``CountingTokens``."""
    components = [replace(c, corpus=Corpus(tuple(replace(s, tokens=CountingTokens(s.tokens, reads))
                                                  for s in c.corpus.spans), c.corpus.seq_len))
                  for c in batches.components]
    return CorpusBatches(components, global_batch_size=batches.global_batch_size, seed=batches.seed)


def _assert_same(got, want) -> None:
    (got_inputs, got_targets), (want_inputs, want_targets) = got, want
    got_all = [*got_inputs, got_targets] if isinstance(got_inputs, tuple) else [got_inputs, got_targets]
    want_all = [*want_inputs, want_targets] if isinstance(want_inputs, tuple) else [want_inputs, want_targets]
    assert len(got_all) == len(want_all)
    for g, w in zip(got_all, want_all):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (g, w)


def _covered(source: CorpusBatches, step: int, rows: tuple[int, int]) -> set[str]:
    """Which hard cases the whole rows of a batch hold: a window starting mid-document, and a document begun
    after the window's first token that runs across a chunk boundary (its id needs the starts before the chunk)."""
    true = source.positions(step, *rows, from_document_start=True)  # (B, T)
    positions = restart_at_window(true)
    ids = document_ids(positions)
    cases = {"starts mid-document"} if bool((true[:, 0] > 0).any()) else set()
    boundaries = sorted({k * T // (2 * cp) for cp in (2, 3, 4) for k in range(1, 2 * cp)})  # chunks' first columns
    if bool(((positions[:, boundaries] > 0) & (ids[:, boundaries] > 1)).any()):
        cases.add("a later document crosses a chunk boundary")
    return cases


@pytest.mark.parametrize("split", ["train", "val"])  # val: spans cut mid-file by the held-out tail
@pytest.mark.parametrize("kind,document_mask", CORPORA)
def test_a_cp_rank_reads_only_its_chunks_and_gets_what_cutting_whole_rows_gives(tmp_path, kind, document_mask, split):
    reads: list[int] = []
    source = _counting(getattr(_data(tmp_path, kind, document_mask), split), reads)
    covered: set[str] = set()
    for step in range(3):
        for rows in [(0, B), (B // 2, B)]:  # the whole batch, and one dp replica's rows
            n = rows[1] - rows[0]
            if document_mask:
                covered |= _covered(source, step, rows)
            for context in CONTEXTS:
                positions = source.positions(step, *rows) if document_mask else None
                want = model_batch(source.rows(step, *rows), positions, context=context)
                reads.clear()
                got = rank_batch(source, step, rows, document_mask=document_mask, context=context)
                _assert_same(got, want)
                # A cp rank copies two chunks of T/(2·cp) inputs and the token after each, no more.
                chunk = T // (2 * context.size)
                assert reads == ([T + 1] * n if context.size == 1 else [chunk + 1] * (2 * n)), (context, reads)
    if document_mask:
        assert covered == {"starts mid-document", "a later document crosses a chunk boundary"}


@pytest.mark.parametrize("kind", ["eod", "megatron", "none"])
def test_any_columns_of_a_window_get_its_positions_and_document_ids(tmp_path, kind):
    """Every range [lo, hi) of every window, not only chunk boundaries: the same as slicing the whole window."""
    data = _data(tmp_path, kind, document_mask=kind != "none")
    for corpus in (data.train.components[0].corpus, data.val.components[0].corpus):
        for g in range(min(10, corpus.windows)):
            window = corpus.window(g)  # (T + 1,)
            positions = restart_at_window(corpus.positions(g)[None])[0]  # (T,)
            ids = document_ids(positions)
            for lo in range(T):
                for hi in range(lo + 1, T + 1):
                    assert torch.equal(corpus.columns(g, lo, hi), window[lo: hi + 1])
                    got_positions, got_ids = corpus.column_documents(g, lo, hi)
                    assert torch.equal(got_positions, positions[lo:hi]) and torch.equal(got_ids, ids[lo:hi]), (g, lo, hi)


@pytest.mark.parametrize("kind,document_mask", CORPORA)
def test_evaluation_windows_read_by_chunks_match_whole_windows(tmp_path, kind, document_mask):
    corpus = _data(tmp_path, kind, document_mask).val.components[0].corpus
    windows = [*range(corpus.windows), 0, 0]  # the last batch is padded with window 0, as evaluate_windows does
    for context in CONTEXTS:
        rows = torch.stack([corpus.window(g) for g in windows])
        positions = restart_at_window(torch.stack([corpus.positions(g) for g in windows])) if document_mask else None
        _assert_same(window_batch(corpus, windows, document_mask=document_mask, context=context),
                     model_batch(rows, positions, context=context))


def test_synthetic_rows_are_still_drawn_whole_and_cut():
    data = build_data("synthetic", vocab_size=97, seq_len=T, global_batch_size=B, seed=3, val_fraction=0.1, eod_token=5)
    for context in CONTEXTS:
        for document_mask in (False, True):
            positions = data.train.positions(2, 0, B) if document_mask else None
            _assert_same(rank_batch(data.train, 2, (0, B), document_mask=document_mask, context=context),
                         model_batch(data.train.rows(2, 0, B), positions, context=context))


@pytest.mark.parametrize("kind,document_mask", CORPORA)
def test_batches_of_one_row_have_a_fresh_tensors_strides(tmp_path, kind, document_mask):
    """A stage compares each input's strides with those it was traced with, a fresh tensor's (torch 2.11's
    pipelining: "stride mismatch: expected (T, 1) actual (T + 1, 1)", seen on an H200 with one-row micro-batches).
    A (1, T) slice of (1, T + 1) rows counts as contiguous, so ``.contiguous()`` keeps the row's stride."""
    data = _data(tmp_path, kind, document_mask)
    for rows in ((0, 1), (0, B)):
        for context in (None, ContextSlice(1, 2)):
            inputs, targets = rank_batch(data.train, 1, rows, document_mask=document_mask, context=context)
            for t in (*(inputs if isinstance(inputs, tuple) else (inputs,)), targets):
                assert t.stride() == torch.empty(t.shape).stride(), (rows, context, t.shape, t.stride())


def test_no_loss_after_an_end_of_document_is_the_same_on_chunks_as_on_whole_rows(tmp_path):
    """--no-loss-across-documents: a target is ignored exactly where its input token is the end-of-document id,
    and a cp rank's chunks get what cutting the whole rows' masked targets gives."""
    data = _data(tmp_path, "eod", True)
    inputs, targets = rank_batch(data.train, 1, (0, B), document_mask=True, context=None)
    masked = without_loss_across_documents(inputs, targets, EOD)
    assert torch.equal(masked == IGNORE_INDEX, inputs[0] == EOD) and bool((inputs[0] == EOD).any())
    assert torch.equal(masked[masked != IGNORE_INDEX], targets[inputs[0] != EOD])
    for context in CONTEXTS:
        chunk_inputs, chunk_targets = rank_batch(data.train, 1, (0, B), document_mask=True, context=context)
        got = without_loss_across_documents(chunk_inputs, chunk_targets, EOD)
        assert torch.equal(got, local_chunks(masked, rank=context.rank, cp=context.size, dim=1))
