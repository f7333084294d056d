"""Chat data's loss: the mean next-token loss over the trained (assistant) targets of the whole global batch.

Training's usual loss is each micro-batch's own mean, divided by the micro-batches m; gradient accumulation sums
those and data parallelism averages over its R = dp x cp ranks, which is the global batch's mean only when every
micro-batch trains on as many targets as every other. Assistant tokens are not spread evenly: one micro-batch may
hold a long answer and the next a long prompt, so a mean of micro-batch means would weigh one answer's tokens
above another's, and differently on every mesh and micro-batching (the reason ``--no-loss-across-documents``
keeps a mean over every position). Here the count N of trained targets of the global batch is known before the
step: every rank sums the packed windows' counts (runtime/engine/data/batches.py ``trained_targets``), no
collective needed. A micro-batch then returns

    loss_mb = R / N * sum of its trained targets' losses      (IGNORE_INDEX targets add nothing)

which summed over the micro-batches and averaged over R ranks is sum / N: the mean over the global batch's
trained targets, exactly as one process computes it, on any mesh and micro-batching. Reported losses undo R
(runtime/engine/step.py divides the summed losses by dp x cp x mp, the mp ranks reporting copies).

The schedule calls ``loss_fn(logits, targets)`` with nothing else, so N travels in a ``TrainedTokens`` the step
sets before running the schedule (``train_step``'s ``trained_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from compiler.parallelize.cross_entropy import token_cross_entropy, vocabulary_shard


@dataclass
class TrainedTokens:
    """The global batch's count of trained targets, for the pass about to run."""

    replicas: int  # R = dp x cp: the ranks data parallelism averages gradients over
    count: int = 0

    def set(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"a batch cannot train on {count} targets")
        self.count = count


def trained_token_cross_entropy(scaler: ShardedGradScaler, tokens: TrainedTokens, *,
                                vocab_mesh: DeviceMesh | None = None, vocab_size: int | None = None):
    """The schedule's loss function for chat data: R / N times the sum of a micro-batch's trained targets' losses
    (module docstring), loss-scaled; vocabulary-parallel with ``vocab_mesh`` as training's usual loss
    (runtime/engine/amp.py ``scaled_cross_entropy``). A batch without a trained target has loss 0."""
    shard = vocabulary_shard(vocab_mesh, vocab_size) if vocab_mesh is not None else None

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        summed = token_cross_entropy(logits, targets, shard=shard, reduction="sum")
        return scaler.scale(summed * (tokens.replicas / max(tokens.count, 1)))

    return loss_fn
