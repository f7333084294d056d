"""Global batches as pure functions of (seed, step), read one rank's rows at a time.

Global batch ``step`` is sequences [step*B, (step+1)*B) of the run's endless sequence of windows
(sampling.py): each source walks its epochs without replacement, and a mixture hands each sequence to a
source by the weights' shares. DP replica d reads rows [d*B/dp, (d+1)*B/dp) of it, and only those: a
rank never reads, decodes or copies another rank's rows. A single process reading rows [0, B) sees
exactly what the mesh sees, and a run resumed at step s on any mesh reads what the uninterrupted run read.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from runtime.engine.data.corpus import Corpus, positions_after_eod, restart_at_window
from runtime.engine.data.packed import PackedCorpus
from runtime.engine.data.sampling import Interleave, derive, epoch_order


@dataclass(frozen=True)
class Component:
    name: str  # the --data path, for reports
    weight: Fraction
    corpus: Corpus | PackedCorpus  # PackedCorpus: chat data (conversations with loss masks)


@dataclass(frozen=True)
class WindowColumns:
    """Some windows, read a range of input columns at a time: a context-parallel rank keeps 1/cp of every
    window (two chunks), so reading whole rows would copy cp times the tokens it uses."""

    windows: list[tuple[Corpus, int]]  # (corpus, global window) of each row

    def tokens(self, lo: int, hi: int) -> torch.Tensor:
        """Input columns [lo, hi) and the token after them: int64 (B, hi - lo + 1), as ``rows(...)[:, lo:hi + 1]``."""
        return torch.stack([corpus.columns(g, lo, hi) for corpus, g in self.windows])

    def documents(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window-relative positions and document ids of columns [lo, hi): int64 (B, hi - lo) each, as the whole
        rows' ``positions`` and ``document_ids`` give them."""
        positions, ids = zip(*(corpus.column_documents(g, lo, hi) for corpus, g in self.windows))
        return torch.stack(positions), torch.stack(ids)


class CorpusBatches:
    """Batches of windows of one corpus, or of a weighted mixture of corpora."""

    def __init__(self, components: list[Component], *, global_batch_size: int, seed: int):
        self.components, self.global_batch_size, self.seed = components, global_batch_size, seed
        self.interleave = Interleave([c.weight for c in components], seed=derive(seed, 0x4D49))
        # Each source's own order: a mixture of one is exactly the plain corpus.
        self.seeds = [seed if len(components) == 1 else derive(seed, k) for k in range(len(components))]

    @property
    def seq_len(self) -> int:
        return self.components[0].corpus.seq_len

    def _windows(self, step: int, start: int, stop: int) -> list[tuple[Corpus, int]]:
        picked = []
        for p in range(step * self.global_batch_size + start, step * self.global_batch_size + stop):
            k, j = self.interleave.assign(p) if len(self.components) > 1 else (0, p)
            corpus = self.components[k].corpus
            picked.append((corpus, epoch_order(j, corpus.windows, self.seeds[k])))
        return picked

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of global batch ``step``: int64 (stop - start, T + 1)."""
        return torch.stack([corpus.window(g) for corpus, g in self._windows(step, start, stop)])

    def columns(self, step: int, start: int, stop: int) -> WindowColumns:
        """Rows [start, stop) of global batch ``step``, read a range of columns at a time (a context-parallel rank)."""
        return WindowColumns(self._windows(step, start, stop))

    def positions(self, step: int, start: int, stop: int, *, from_document_start: bool = False) -> torch.Tensor:
        """Each input token's position within its document for the same rows: int64 (stop - start, T).

        By default a document begun before the window counts from the window's first token (Megatron's
        ``reset_position_ids``), so every position is < T and fits a learned position table of T rows;
        ``from_document_start`` counts from the document's true start (for rotary positions)."""
        true = torch.stack([corpus.positions(g) for corpus, g in self._windows(step, start, stop)])
        return true if from_document_start else restart_at_window(true)

    def loss_mask(self, step: int, start: int, stop: int) -> torch.Tensor | None:
        """Chat data: which targets of the same rows are trained (assistant tokens), bool (stop - start, T); else
        None (every target is)."""
        if not isinstance(self.components[0].corpus, PackedCorpus):  # build.py mixes no chat with plain data
            return None
        return torch.stack([corpus.target_mask(g) for corpus, g in self._windows(step, start, stop)])

    def trained_targets(self, step: int) -> int:
        """Chat data: the trained targets of the whole global batch ``step``, the count its loss is a mean over
        (runtime/engine/token_mean.py): known to every rank from the windows' counts, no rank's rows read."""
        return sum(corpus.trained_targets(g) for corpus, g in self._windows(step, 0, self.global_batch_size))

    def sequences(self, steps: int) -> list[int]:
        """Sequences each source has given after ``steps`` global batches."""
        n = steps * self.global_batch_size
        if len(self.components) == 1:
            return [n]
        return [self.interleave.count(k, n) for k in range(len(self.components))]

    def epochs(self, steps: int) -> list[float]:
        """Epochs of each source completed after ``steps`` global batches (1.5: once through, half again)."""
        return [n / c.corpus.windows for n, c in zip(self.sequences(steps), self.components)]

    def shares(self, steps: int) -> list[float]:
        """Each source's realised share of the sequences (and tokens) after ``steps`` global batches."""
        counts = self.sequences(steps)
        return [n / max(1, sum(counts)) for n in counts]


class SyntheticBatches:
    """Seeded uniform random tokens, for benchmarks: no file, no tokenisation cost. Row r of batch s is drawn
    from a generator seeded by (seed, s, r), so a rank draws only its own rows."""

    def __init__(self, *, vocab_size: int, seq_len: int, global_batch_size: int, seed: int, eod: int | None = None):
        self.vocab_size, self.seq_len, self.global_batch_size, self.seed, self.eod = (
            vocab_size, seq_len, global_batch_size, seed, eod)

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        out = torch.empty(stop - start, self.seq_len + 1, dtype=torch.int64)
        for i, r in enumerate(range(start, stop)):
            g = torch.Generator().manual_seed(derive(self.seed, step, r) & 0x7FFFFFFFFFFFFFFF)
            out[i] = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        return out

    def positions(self, step: int, start: int, stop: int, *, from_document_start: bool = False) -> torch.Tensor:
        """As ``CorpusBatches.positions``; a row drawn on its own starts a document, so both counts agree."""
        inputs = self.rows(step, start, stop)[:, :-1]
        if self.eod is None:
            return torch.arange(self.seq_len).expand(stop - start, -1).clone()
        return positions_after_eod(inputs, self.eod)

    def loss_mask(self, step: int, start: int, stop: int) -> None:
        return None  # every target is trained

    @property
    def components(self) -> list[Component]:
        return []  # no data source to report epochs or shares of

    def sequences(self, steps: int) -> list[int]:
        return []

    def epochs(self, steps: int) -> list[float]:
        return []

    def shares(self, steps: int) -> list[float]:
        return []


def replica_rows(global_batch_size: int, dp_rank: int, dp: int) -> tuple[int, int]:
    per = global_batch_size // dp
    return dp_rank * per, (dp_rank + 1) * per


def inputs_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) tokens -> inputs (B, T) and next-token targets (B, T)."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
