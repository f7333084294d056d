"""Chat data as the engine samples it: windows of whole conversations (packing.py) over memory-mapped token and
mask files, read as corpus.py's ``Corpus`` is read (``window``, ``positions``, ``columns``,
``column_documents``), plus each window's loss mask and trained-target count.

A window is its conversations one after another, then padding (``PAD_ID``) up to T + 1 tokens. Positions
restart at 0 on every conversation's first token and on the padding's, so the document ids of
``--document-mask`` (inputs.py ``document_ids``) keep conversations from attending to each other and the padding
is a document of its own. The targets are tokens 1 to T; a target is trained where its token's mask bit is
set (an assistant token), so the token after a conversation's end, the next one's first (a prompt token),
never is. ``trained_targets`` counts them per window, read once when the corpus is built: the global batch's
count, which the SFT loss divides by, is a sum over its windows (runtime/engine/token_mean.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.data.loss_mask import TRAINED

PAD_ID = 0  # what fills a window after its conversations: any id of the vocabulary, never a target


@dataclass(frozen=True, slots=True)  # one per conversation on every rank: kept small
class Piece:
    """Tokens [start, start + length) of file ``file``: a conversation, or its first part (truncated)."""

    file: int
    start: int
    length: int
    trained: int  # trained tokens among them


@dataclass(frozen=True)
class ChatFile:
    name: str  # for messages
    tokens: torch.Tensor  # (n,) memory-mapped ids
    mask: torch.Tensor  # (n,) memory-mapped uint8 (loss_mask.py)


class PackedCorpus:
    """Windows of whole conversations; ``layout[w]`` lists window w's pieces in order."""

    def __init__(self, files: list[ChatFile], windows: list[list[Piece]], seq_len: int):
        self.files, self.layout, self.seq_len = files, windows, seq_len
        capacity = seq_len + 1
        for w, pieces in enumerate(windows):
            if not pieces or sum(p.length for p in pieces) > capacity:
                raise ValueError(f"window {w} holds {sum(p.length for p in pieces)} tokens; one holds 1 to {capacity}")
        # The window's first token is never a target: its trained bit (if any) is not counted.
        self.trained = [sum(p.trained for p in pieces) - int(files[pieces[0].file].mask[pieces[0].start]) % 2
                        for pieces in windows]
        self.conversation_tokens = sum(p.length for pieces in windows for p in pieces)

    @property
    def windows(self) -> int:
        return len(self.layout)

    @property
    def conversations(self) -> int:
        return sum(len(pieces) for pieces in self.layout)

    @property
    def trained_total(self) -> int:
        return sum(self.trained)

    @property
    def fill(self) -> float:
        """Conversation tokens over window tokens: 1 - the share of padding."""
        return self.conversation_tokens / max(1, self.windows * (self.seq_len + 1))

    def _gather(self, g: int, which: str, pad: int) -> torch.Tensor:
        """Window ``g``'s (T + 1,) tokens or mask bytes, padding after its pieces."""
        out = torch.full((self.seq_len + 1,), pad, dtype=torch.int64)
        at = 0
        for p in self.layout[g]:
            out[at: at + p.length] = getattr(self.files[p.file], which)[p.start: p.start + p.length]
            at += p.length
        return out

    def window(self, g: int) -> torch.Tensor:
        """(T + 1,) int64 tokens."""
        return self._gather(g, "tokens", PAD_ID)

    def positions(self, g: int) -> torch.Tensor:
        """(T,) each input's position in its conversation (0 on its first token; the padding counts from 0 too)."""
        out, at = torch.empty(self.seq_len + 1, dtype=torch.int64), 0
        for p in self.layout[g]:
            out[at: at + p.length] = torch.arange(p.length)
            at += p.length
        out[at:] = torch.arange(self.seq_len + 1 - at)
        return out[:-1]

    def target_mask(self, g: int) -> torch.Tensor:
        """(T,) bool: target t (token t + 1) is trained."""
        return (self._gather(g, "mask", 0)[1:] & TRAINED).bool()

    def trained_targets(self, g: int) -> int:
        return self.trained[g]

    def columns(self, g: int, lo: int, hi: int) -> torch.Tensor:
        """Input columns [lo, hi) and the token after them: (hi - lo + 1,). A window is built whole (T + 1 tokens
        from a handful of slices) and cut: reading only the columns would save little."""
        return self.window(g)[lo: hi + 1]

    def column_documents(self, g: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and document ids (counted over the whole window: inputs.py ``document_ids``) of columns [lo, hi)."""
        positions = self.positions(g)
        return positions[lo:hi], (positions == 0).long().cumsum(-1)[lo:hi]
