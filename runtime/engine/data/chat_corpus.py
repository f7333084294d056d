"""Chat token files -> packed corpora to train and validate on: conversations read from the masks (loss_mask.py),
fitted to the window (``--long-conversations``), those left without a trained target skipped (they would add
nothing to the loss), the validation share held out, then packed (packing.py, packed.py). What was cut, left
out and how full the windows are goes into the data's description, which training prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.data.corpus import DataError
from runtime.engine.data.loss_mask import TRAINED, conversations, map_mask
from runtime.engine.data.packed import ChatFile, PackedCorpus, Piece
from runtime.engine.data.packing import best_fit_decreasing, fit_to_window, one_per_window
from runtime.engine.data.token_files import TokenFile


@dataclass(frozen=True)
class PackingOptions:
    seq_len: int
    long_conversations: str = "truncate"  # "truncate" or "drop" (packing.py)
    packing: bool = True  # several conversations per window; else one each, padded


@dataclass(frozen=True)
class Counts:
    """What became of a set of conversations."""

    conversations: int  # packed
    truncated: int
    dropped: int  # longer than a window, with --long-conversations drop
    untrained: int  # no trained target left: skipped

    def describe(self, corpus: PackedCorpus, options: PackingOptions) -> str:
        what = "packed into" if options.packing else "one per window:"
        text = (f"{self.conversations:,} conversations {what} {corpus.windows:,} windows ({corpus.fill:.1%} "
                f"filled), {corpus.trained_total:,} trained tokens")
        if self.truncated or self.dropped:
            text += (f"; {self.truncated:,} truncated to {options.seq_len + 1} tokens (--long-conversations truncate)"
                     if self.truncated else f"; {self.dropped:,} longer than {options.seq_len + 1} tokens dropped "
                     f"(--long-conversations drop)")
        if self.untrained:
            text += f"; {self.untrained:,} without an assistant token skipped"
        return text


def chat_files(files: list[TokenFile], masks: dict[Path, Path], *, flag: str) -> list[ChatFile]:
    return [ChatFile(str(f.path), f.map(), map_mask(masks[f.path], count=f.count, flag=flag)) for f in files]


def packed_corpora(files: list[TokenFile], masks: dict[Path, Path], options: PackingOptions, *, flag: str,
                   cache_dir: Path | None, hold_out: float | None = None, name: str | None = None
                   ) -> tuple[tuple[PackedCorpus, Counts], tuple[PackedCorpus, Counts] | None]:
    """The conversations of ``files`` packed: (corpus, counts), and with ``hold_out`` the last fraction of them
    (at least one) packed apart for validation. ``name``: what the user gave ``flag`` (JSON lines are read from token
    files in the cache, whose names mean nothing to them), for messages; default: the files'."""
    chats = chat_files(files, masks, flag=flag)
    pieces = []  # every conversation, in file order
    for k, (file, chat) in enumerate(zip(files, chats)):
        found = conversations(masks[file.path], count=file.count, flag=flag, cache_dir=cache_dir)
        pieces += [Piece(k, s, n, t) for s, n, t in zip(found.starts.tolist(), found.lengths.tolist(),
                                                        found.trained.tolist())]
    name = name or (files[0].path if len(files) == 1 else f"{files[0].path} and {len(files) - 1} more")
    if hold_out is None:
        return _packed(chats, pieces, options, name=name, flag=flag), None
    n_val = max(1, math.ceil(len(pieces) * hold_out))
    if len(pieces) - n_val < 1:
        raise DataError(f"{flag} {name} holds {len(pieces)} conversation(s): too few to hold out a validation share "
                        f"and train on the rest; give --val-data or more conversations")
    return (_packed(chats, pieces[:-n_val], options, name=name, flag=flag),
            _packed(chats, pieces[-n_val:], options, name=f"{name} (validation share)", flag=flag))


def _packed(chats: list[ChatFile], pieces: list[Piece], options: PackingOptions, *, name: object,
            flag: str) -> tuple[PackedCorpus, Counts]:
    capacity = options.seq_len + 1
    fitted = fit_to_window([p.length for p in pieces], capacity=capacity, policy=options.long_conversations)
    kept = []
    for piece, n in zip(pieces, fitted.kept):
        if n == 0:
            continue
        if n < piece.length:  # truncated: count the trained tokens it keeps
            mask = chats[piece.file].mask[piece.start: piece.start + n]
            piece = Piece(piece.file, piece.start, n, int((mask & TRAINED).sum()))
        kept.append(piece)
    trained = [p for p in kept if p.trained > 0]
    if not trained:
        raise DataError(f"{flag} {name}: no conversation has an assistant token to train on within --seq-len "
                        f"{options.seq_len} + 1 tokens ({len(pieces):,} conversations, {fitted.dropped:,} dropped as "
                        f"too long)" + ("; use --long-conversations truncate or a longer --seq-len" if fitted.dropped
                                        else ""))
    lengths = [p.length for p in trained]
    layout = best_fit_decreasing(lengths, capacity=capacity) if options.packing else one_per_window(lengths)
    corpus = PackedCorpus(chats, [[trained[i] for i in window] for window in layout], options.seq_len)
    return corpus, Counts(len(trained), fitted.truncated, fitted.dropped, len(kept) - len(trained))
