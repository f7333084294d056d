"""Load balancing of a mixture's experts: the sequence-wise auxiliary loss, and the auxiliary-loss-free bias update.

**Auxiliary loss** (the f.P form of Switch Transformer, Fedus et al. 2021, taken per sequence as DeepSeek-V3's
sequence-wise balance loss, sec. 2.1.2 eq. 17-20). For one sequence of T tokens and one MoE layer with E
experts, k per token::

    f_i = E / (k T) * (assignments of the sequence's tokens to expert i)      (1 for every i when balanced)
    P_i = 1 / T * sum_t s_it / sum_j s_jt                                      (softmax scores already sum to 1)
    L   = sum_i f_i P_i                                                        (1 when balanced)

The layer's loss is L averaged over the batch's sequences (rows), and the model's is ``coef`` times the sum over
its MoE layers (``coef``: the configs' ``router_aux_loss_coef``). Each term depends on its own sequence only,
so a global batch's loss is the mean of its micro-batches' and replicas' losses however the batch is split
(equal micro-batches): exact against one process. (Hugging Face's ``load_balancing_loss_func`` pools the
tokens of the whole batch and of all layers before multiplying, which depends on the split; its fixtures'
losses carry no auxiliary term.) f counts choices and has no gradient; the router learns through P.

The loss is not returned with the logits: ``attach_aux_loss`` returns the block's output unchanged and, in
backward, also back-propagates ``grad_scale`` into the auxiliary loss (Megatron-LM's MoEAuxLossAutoScaler), so
its gradient reaches the router of every pipeline stage with the activations' own backward, whatever the
schedule. **Scale convention** (runtime/engine/amp.py ``scaled_cross_entropy``): the engine back-propagates
S * CE_mb / m for each micro-batch (S the fp16 loss scale, 1 without scaling; m micro-batches per step). The
gradient of S * (CE_mb + coef * sum_layers L_mb) / m is therefore reached with ``grad_scale = coef * S / m``.

**The loss as a module** (``BalanceLoss``, each MoE block's ``balance``): the block hands it the router's scores
and choices and gets its output back with the gradient attached. Its forward's keyword options are what only the
engine knows: the sequence split (``shards``, ``sum_over_shards``) and the step's scale S / m (``grad_scale``).
Their defaults are one process and one micro-batch without loss scaling, so a model alone computes the gradient
of a plain ``loss.backward()`` of the mean cross-entropy. The engine wraps the module to pass its own
(compiler/parallelize/expert_parallel.py); the model never learns about it. Data parallelism then averages these
gradients over replicas as it averages the cross-entropy's.

**Bias update** (DeepSeek-V3 sec. 2.1.2; Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"): after each
optimizer step, ``bias += gamma * sign(mean load - load)`` per expert, the load being the tokens routed to each
expert during the step, summed over data-parallel ranks first (every replica must apply the same update).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, *, batch: int, shards: int = 1,
                          sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """L averaged over the sequences (0-d, fp32), from the router's (N, E) scores and (N, k) chosen experts of
    N = batch * T tokens laid out sequence by sequence (the (B, T) order of the block's input).

    A sequence may be split over ``shards`` ranks (sequence or context parallelism: each holds T/shards of its
    tokens): ``sum_over_shards`` then sums a tensor over them (no gradient), giving f its whole-sequence counts,
    and this rank's share of L is returned, sum_i f_i P_i^r with P_i^r its own tokens' part of P_i. The shares
    add up to L, and each one's gradient is exactly L's gradient through this rank's tokens."""
    n, n_experts = scores.shape
    k = experts.shape[1]
    per_sequence = n // batch  # this rank's tokens of each sequence
    whole = per_sequence * shards  # T
    chosen = experts.reshape(batch, per_sequence * k)  # (B, T k)
    counts = scores.new_zeros(batch, n_experts).scatter_add(1, chosen, scores.new_ones(chosen.shape))  # (B, E)
    if sum_over_shards is not None:
        counts = sum_over_shards(counts)
    f = counts * (n_experts / (k * whole))  # (B, E)
    p = (scores / scores.sum(-1, keepdim=True)).reshape(batch, per_sequence, n_experts).sum(1) / whole  # (B, E)
    return (f * p).sum(-1).mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activations; in backward the auxiliary loss also gets the gradient ``grad_scale``."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        ctx.aux_like = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return activations

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.grad_scale, dtype=dtype, device=device), None


def attach_aux_loss(activations: torch.Tensor, aux_loss: torch.Tensor, *, grad_scale: float) -> torch.Tensor:
    """``activations`` unchanged; their backward also back-propagates d(grad_scale * aux_loss)."""
    return _AttachAuxLoss.apply(activations, aux_loss, grad_scale)


class BalanceLoss(nn.Module):
    """One MoE layer's auxiliary loss, ``coef`` times L (the configs' ``router_aux_loss_coef``); no parameters."""

    def __init__(self, coef: float):
        super().__init__()
        self.coef = coef

    def forward(self, out: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, *, batch: int, shards: int = 1,
                sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None,
                grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(``out`` unchanged, whose backward also back-propagates d(grad_scale * coef * L); L detached, 0-d fp32)
        from the router's (N, E) scores and (N, k) choices of ``batch`` sequences (``sequence_balance_loss``)."""
        aux = sequence_balance_loss(scores, experts, batch=batch, shards=shards, sum_over_shards=sum_over_shards)
        return attach_aux_loss(out, aux, grad_scale=self.coef * grad_scale), aux.detach()


def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """The new selection bias, ``bias + gamma * sign(mean(counts) - counts)``: (E,) bias (a router's
    ``expert_bias``), (E,) tokens routed to each expert over the step, already summed over the data-parallel
    ranks; ``gamma`` the update speed (DeepSeek-V3: 0.001, then 0 for its last 500B tokens). An overloaded expert's
    bias falls by gamma, an underloaded one's rises; a pure function: the caller writes the result into the
    parameter (``router.expert_bias.copy_(...)`` under no_grad), after the optimizer step."""
    load = counts.to(torch.float32)
    return bias + gamma * torch.sign(load.mean() - load).to(bias.dtype)
