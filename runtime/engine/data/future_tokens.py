"""The targets of a run with multi-token prediction (models/common/mtp.py): everything the last pipeline stage needs for
the depths' losses, handed over with the next-token targets as one int64 tensor (the schedule gives its loss function
one target per micro-batch, and only the last stage has them).

Depth k at position i takes t_{i+k} (its input) and predicts t_{i+k+1} (its label): the input tokens and the targets
shifted k columns left. Past the window there is neither (input 0, label ``IGNORE_INDEX``). Under ``--document-mask``
a position whose t_{i+k} lies in a later document than t_i gets no label: no prediction across a document boundary
(the model's attention already keeps h^{k-1}_i inside its document, and the depth's block attends per document too).
Under ``--no-loss-across-documents`` a label whose input is the end-of-document token is ignored, as the main target
after it is (``mask_after_end_of_document``).

Shifting crosses chunk boundaries under context parallelism: a rank's chunk [lo, hi) needs input columns up to
hi + D - 1 and the target after the last, which other ranks' chunks hold. The data loader reads those D columns with
the chunk instead of exchanging them (runtime/engine/data/inputs.py ``chunked_model_batch``); cutting whole rows gives
the same tensors.

Layout (B, T, 2D + 1 + E): columns 0..D the labels (0 the next token, the main loss's; k depth k's), D+1..2D the
depths' inputs t_{i+k}, then the model's E other inputs (positions, document ids) as the model takes them: the depths'
blocks take them as the model's blocks do, and a last stage that holds no block has no other way to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.parallelize.cross_entropy import IGNORE_INDEX


@dataclass(frozen=True)
class FutureTargets:
    labels: torch.Tensor  # (B, T, D + 1): column 0 the main loss's, column k depth k's; IGNORE_INDEX where none
    future: torch.Tensor  # (B, T, D): column k - 1 the depth's input token t_{i+k} (0 past the window)
    extras: tuple[torch.Tensor, ...]  # the model's positions (and document ids), (B, T) each

    @staticmethod
    def of(target: torch.Tensor, depth: int) -> FutureTargets:
        """The parts of a stacked target (``stack_targets``) of ``depth`` depths."""
        extras = tuple(target[..., c] for c in range(2 * depth + 1, target.shape[-1]))
        return FutureTargets(target[..., :depth + 1], target[..., depth + 1:2 * depth + 1], extras)


def shifted(x: torch.Tensor, k: int, *, length: int, fill: int) -> torch.Tensor:
    """Columns k .. k + length - 1 of (B, N) ``x``, ``fill`` past its last column: (B, length)."""
    part = x[:, k:k + length]
    if part.shape[1] == length:
        return part
    return torch.cat([part, part.new_full((x.shape[0], length - part.shape[1]), fill)], dim=1)


def future_columns(tokens: torch.Tensor, targets: torch.Tensor, *, depth: int, length: int,
                   documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (B, length, D + 1), inputs (B, length, D)) of the first ``length`` columns, from (B, N) input tokens
    and targets that continue up to D columns past them (N <= length + D: fewer where the window ends) and, for
    packed documents, their (B, N) document ids."""
    labels, inputs = [targets[:, :length]], []
    for k in range(1, depth + 1):
        label = shifted(targets, k, length=length, fill=IGNORE_INDEX)
        if documents is not None:  # t_{i+k} in a later document than t_i: nothing to predict across the boundary
            later = shifted(documents, k, length=length, fill=-1) != documents[:, :length]
            label = label.masked_fill(later, IGNORE_INDEX)
        labels.append(label)
        inputs.append(shifted(tokens, k, length=length, fill=0))
    return torch.stack(labels, dim=-1), torch.stack(inputs, dim=-1)


def stack_targets(labels: torch.Tensor, inputs: torch.Tensor, extras: list[torch.Tensor]) -> torch.Tensor:
    """The (B, T, 2D + 1 + E) target (module docstring)."""
    return torch.cat([labels, inputs, *(e.unsqueeze(-1) for e in extras)], dim=-1)


def mask_after_end_of_document(target: torch.Tensor, tokens: torch.Tensor, eod: int, depth: int) -> torch.Tensor:
    """``target`` (stacked) with every label ``IGNORE_INDEX`` whose input token is ``eod``: the main label where the
    position's token is, depth k's where t_{i+k} is (per position: a context-parallel rank's chunks get what masking
    the whole rows gives)."""
    parts = FutureTargets.of(target, depth)
    inputs = torch.cat([tokens.unsqueeze(-1), parts.future], dim=-1)  # (B, T, D + 1): each label's input token
    return torch.cat([parts.labels.masked_fill(inputs == eod, IGNORE_INDEX), target[..., depth + 1:]], dim=-1)
