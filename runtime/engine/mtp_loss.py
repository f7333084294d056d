"""The training objective with multi-token prediction (DeepSeek-V3 technical report, sec. 2.2), computed where the
targets are: on the last pipeline stage, in the schedule's loss function.

The last stage's traced graph returns the logits and h^0, the hidden state before the final norm (compiler/trace.py);
the stage also holds the model's ``mtp`` module, which no graph calls (compiler/parallelize/stages.py). The loss
function runs it on h^0 with the depths' input tokens and the model's positions and document ids, all carried by the
stacked target (runtime/engine/data/future_tokens.py), then (eq. 24-25):

    L = L_main + weight * (1/D) sum_k L_k,      L_k = (1/N) sum over positions with a label of -log P^k_i[t_{i+k+1}]

N counting every position of the micro-batch (B x T on one process, B x T/cp on a context-parallel rank): the
report's 1/T, so positions past the window or across a document boundary count zero, and every micro-batch and rank
has the same denominator; the engine's sum over micro-batches and mean over replicas is then the global batch's mean
on any mesh. Each L_k runs on vocabulary-sharded logits under TP as the main loss does
(compiler/parallelize/cross_entropy.py).

Without gradients (validation) the depths are not run and the loss is the next-token loss alone: MTP is a training
objective, and DeepSeek-V3 drops its modules at inference.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from compiler.parallelize.cross_entropy import VocabularyShard, token_cross_entropy
from models import MTP
from models.spec import LM_HEAD
from runtime.engine.data.future_tokens import FutureTargets

NextTokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> the main loss


class MtpObjective:
    """The last stage's depths and head, and the step's MTP losses as it records them. ``gather``: makes the stage's
    own parameters whole before the depths use them (the head, the embedding's copy: FSDP's root unit, which ZeRO-3
    reshards after the stage's forward); None where nothing is sharded."""

    def __init__(self, mtp: nn.Module, head: nn.Module, *, depth: int, weight: float, shard: VocabularyShard | None,
                 gather: Callable[[], None] | None = None):
        self.mtp, self.head, self.depth, self.weight, self.shard, self.gather = mtp, head, depth, weight, shard, gather
        self._recorded: list[torch.Tensor] = []

    def loss(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor,
             next_token: NextTokenLoss) -> torch.Tensor:
        """L of one micro-batch from the stage's (logits, h^0) and its stacked target (module docstring)."""
        logits, hidden = output
        parts = FutureTargets.of(target, self.depth)
        main = next_token(logits, parts.labels[..., 0])
        if not torch.is_grad_enabled():
            return main
        if self.gather is not None:
            self.gather()  # a no-op where the root kept them gathered; its backward reshards them as usual
        # A copy: after the input pass of a split backward (zero-bubble schedules) torch's stage detaches the last
        # stage's outputs in place, and the weight pass still needs what the depths' first ops saved of h^0.
        depth_logits = self.mtp(hidden.clone(), parts.future, self.head, *parts.extras)  # D x (b, t, V or V/mp)
        losses = [token_cross_entropy(lg, parts.labels[..., k + 1], shard=self.shard, reduction="sum")
                  / parts.labels[..., k + 1].numel() for k, lg in enumerate(depth_logits)]
        mtp = torch.stack(losses).mean()
        self._recorded.append(mtp.detach())
        return main + self.weight * mtp

    def take_mean(self) -> torch.Tensor | None:
        """The mean over this step's micro-batches of (1/D) sum_k L_k (float64, 0-d), None where no loss was computed
        (not the last stage); forgets them."""
        if not self._recorded:
            return None
        mean = torch.stack(self._recorded).double().mean()
        self._recorded.clear()
        return mean


def mtp_objective(stage_module: nn.Module, *, depth: int, weight: float,
                  shard: VocabularyShard | None) -> MtpObjective:
    """The objective over the last stage's ``mtp`` module and LM head."""
    gather = (lambda: stage_module.unshard()) if isinstance(stage_module, FSDPModule) else None
    return MtpObjective(stage_module.get_submodule(MTP), stage_module.get_submodule(LM_HEAD), depth=depth,
                        weight=weight, shard=shard, gather=gather)
