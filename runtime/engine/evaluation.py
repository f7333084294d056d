"""Language-model evaluation: loss -> perplexity (and bits per byte), and a whole validation set, every window once.

Perplexity is exp of the mean next-token loss in nats. For byte-level text a token is one UTF-8 byte,
so bits per byte is the loss / ln 2 (the unit compression benchmarks and nanoGPT's character models use).

``evaluate_windows`` runs every window of a corpus exactly once through the same pipeline as training
(forward only). Batches keep the traced micro-batch shape, so the last one is filled with repeated
windows whose targets are ignored; the schedule's loss function sums token losses (``summed_cross_entropy``),
so the mean is over exactly the corpus's N x T predicted tokens; for chat data (packed conversations) over
exactly its trained (assistant) targets: the loss training minimises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from compiler.parallelize.cross_entropy import IGNORE_INDEX, token_cross_entropy, vocabulary_shard
from runtime.engine.data.batches import WindowColumns
from runtime.engine.data.corpus import Corpus, restart_at_window
from runtime.engine.data.inputs import (
    ContextSlice,
    Inputs,
    chunked_model_batch,
    model_batch,
    with_loss_mask,
    without_loss_across_documents,
)
from runtime.engine.data.packed import PackedCorpus
from runtime.engine.step import PipelineContext, run_schedule


def language_model_metrics(loss: float, *, byte_level: bool) -> dict[str, float]:
    """{"loss", "perplexity"} and, for byte-level tokens, "bits_per_byte"."""
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}  # exp(709) overflows a float
    if byte_level:
        metrics["bits_per_byte"] = loss / math.log(2)
    return metrics


def summed_cross_entropy(*, vocab_mesh: DeviceMesh | None, vocab_size: int):
    """The schedule's loss function for evaluation: the *sum* of one micro-batch's token losses, skipping
    ``IGNORE_INDEX`` targets; on vocabulary-sharded logits (mp > 1) as in training."""
    shard = vocabulary_shard(vocab_mesh, vocab_size) if vocab_mesh is not None else None

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(logits, targets, shard=shard, reduction="sum")

    return loss_fn


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean next-token loss over every predicted token, nats
    perplexity: float
    bits_per_byte: float | None  # byte-level tokens only
    tokens: int  # predicted tokens: windows x T (chat data: the trained targets)
    windows: int


def window_batch(corpus: Corpus | PackedCorpus, windows: list[int], *, document_mask: bool,
                 context: ContextSlice | None) -> tuple[Inputs, torch.Tensor]:
    """Windows ``windows`` of ``corpus`` as this rank's (inputs, targets), as training makes them; a
    context-parallel rank reads only its chunks' columns of each window (runtime/engine/data/inputs.py)."""
    if context is not None and context.size > 1:
        inputs, targets = chunked_model_batch(WindowColumns([(corpus, g) for g in windows]), seq_len=corpus.seq_len,
                                              document_mask=document_mask, context=context)
    else:
        rows = torch.stack([corpus.window(g) for g in windows])  # (B, T + 1)
        positions = restart_at_window(torch.stack([corpus.positions(g) for g in windows])) if document_mask else None
        inputs, targets = model_batch(rows, positions, context=context)
    mask = torch.stack([corpus.target_mask(g) for g in windows]) if isinstance(corpus, PackedCorpus) else None
    return inputs, with_loss_mask(targets, mask, context=context)


def evaluate_windows(ctx: PipelineContext, corpus: Corpus | PackedCorpus, *, global_batch_size: int,
                     replica_rows: tuple[int, int], sum_copies: int, byte_level: bool, document_mask: bool = False,
                     context: ContextSlice | None = None, eod_without_loss: int | None = None) -> Evaluation:
    """Every window of ``corpus`` once, in file order; this replica reads rows ``replica_rows`` of each batch.
    ``sum_copies``: ranks reporting the same replica's sum (its mp last-stage ranks; context-parallel ranks sum
    other tokens). ``document_mask``: the model also takes each token's position in its document and its
    document's id (counted from the window as in training); ``context``: this rank's chunks of each window;
    ``eod_without_loss``: no loss on the token after this id (--no-loss-across-documents), counted as zero."""
    n, (start, stop) = corpus.windows, replica_rows
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for first in range(0, n, global_batch_size):
        windows = range(first + start, first + stop)
        inputs, targets = window_batch(corpus, [g if g < n else 0 for g in windows], document_mask=document_mask,
                                       context=context)
        if eod_without_loss is not None:
            targets = without_loss_across_documents(inputs, targets, eod_without_loss)
        targets[torch.tensor([g >= n for g in windows])] = IGNORE_INDEX  # padding rows of the last batch
        inputs = tuple(t.to(ctx.device) for t in inputs) if isinstance(inputs, tuple) else inputs.to(ctx.device)
        losses = run_schedule(ctx, inputs, targets.to(ctx.device), train=False)
        if losses:
            total += torch.stack(losses).detach().double().sum().to(ctx.device)
    if dist.is_initialized():
        dist.all_reduce(total)
    tokens = corpus.trained_total if isinstance(corpus, PackedCorpus) else n * corpus.seq_len
    loss = float(total) / sum_copies / max(tokens, 1)
    metrics = language_model_metrics(loss, byte_level=byte_level)
    return Evaluation(loss, metrics["perplexity"], metrics.get("bits_per_byte"), tokens, n)
