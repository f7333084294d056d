"""The single-process reference every parallel configuration is checked against.

A plain PyTorch loop, no engine code on the compute path: the whole model on one process, trained on
the whole global batch with the same initial weights, data rows, optimizer settings and clipping.

With ``--fp8`` the model's linears and experts are swapped to the recipe (compiler/fp8) and the global batch runs
as the mesh's micro-batches, one forward and backward each, gradients accumulated: FP8 scales are taken per
tensor of one product, so one process quantizes each micro-batch apart, as the mesh does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from compiler.fp8 import RECIPES, swap_grouped_experts, swap_linears
from compiler.lora import is_adapter
from compiler.parallelize.lora import apply_lora
from models import MoE, build_model, update_expert_bias
from runtime.checkpoint.weights import initial_values
from runtime.config import TrainConfig
from runtime.engine.data import build_data_from_config
from runtime.engine.data.inputs import model_batch
from runtime.engine.optim import build_lr_schedule, build_optimizer


@dataclass
class ReferenceRun:
    losses: list[float]
    grad_norms: list[float]
    first_step_grads: dict[str, torch.Tensor]  # by parameter name, before clipping
    final_val_loss: float | None = None  # the mean loss over --eval-batches validation batches after the last step
    mtp_losses: list[float] = field(default_factory=list)  # the MTP depths' mean loss per step (--mtp-depth)


def train_reference(cfg: TrainConfig, *, steps: int) -> ReferenceRun:
    torch.manual_seed(cfg.seed)
    data = build_data_from_config(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
                                  global_batch_size=cfg.global_batch_size, seed=cfg.seed)
    model = build_model(cfg.model, seed=cfg.seed)
    if cfg.lora is not None:
        _add_adapters(model, cfg)
    if cfg.plan.fp8:
        swap_linears(model, RECIPES[cfg.plan.fp8])
        swap_grouped_experts(model, RECIPES[cfg.plan.fp8])
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                weight_decay=cfg.optim.weight_decay)
    schedule = build_lr_schedule(optimizer, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.optim.steps)
    run = ReferenceRun([], [], {})
    for step in range(steps):
        loss = _accumulated_loss(model, data.train, step, cfg, run)
        if step == 0:
            run.first_step_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        _update_expert_biases(model, rate=cfg.expert_bias_rate)
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        run.grad_norms.append(norm.item())
    if cfg.data.eval_every:
        with torch.no_grad():
            run.final_val_loss = sum(_batch_loss(model, data.val, i, cfg).item()
                                     for i in range(cfg.data.eval_batches)) / cfg.data.eval_batches
    return run


def _add_adapters(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """LoRA's adapters on the targeted modules, everything else frozen, the adapters' values as the engine's."""
    apply_lora(model, cfg.lora)
    value = initial_values(None, cfg.model, seed=cfg.seed, lora=cfg.lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(value(name, tuple(param.shape)))


def _accumulated_loss(model: torch.nn.Module, source, index: int, cfg: TrainConfig, run: ReferenceRun) -> torch.Tensor:
    """Backward of global batch ``index``'s training loss (the mean next-token loss, plus the MTP depths' mean loss
    weighted, recorded in ``run``), whole (fp32) or micro-batch by micro-batch (FP8: rows [r B / dp + j mbs, + mbs)
    are replica r's micro-batch j); returns the loss."""
    n, mbs = ((cfg.global_batch_size // cfg.plan.micro_batch_size, cfg.plan.micro_batch_size) if cfg.plan.fp8
              else (1, cfg.global_batch_size))
    if n > 1:
        for layer in (m for m in model.modules() if isinstance(m, MoE) and m.balance is not None):
            if not isinstance(layer.balance, _ScaledBalance):
                layer.balance = _ScaledBalance(layer.balance, 1 / n)  # each micro-batch's share of the mean
    total, mtp_total = torch.zeros(()), torch.zeros(())
    for k in range(n):
        loss, mtp = _batch_losses(model, source, index, cfg, rows=(k * mbs, mbs))
        if mtp is not None:
            loss = loss + cfg.mtp_loss_weight * mtp
            mtp_total += mtp.detach() / n
        (loss / n).backward()
        total += loss.detach() / n
    if cfg.model.mtp_depth:
        run.mtp_losses.append(mtp_total.item())
    return total


class _ScaledBalance(torch.nn.Module):
    """A MoE layer's auxiliary loss (a mean over the batch's sequences) with its gradient scaled by ``scale``."""

    def __init__(self, loss: torch.nn.Module, scale: float):
        super().__init__()
        self.loss, self.scale = loss, scale

    def forward(self, *args, **kwargs):
        return self.loss(*args, **kwargs, grad_scale=self.scale)


def _batch_loss(model: torch.nn.Module, source, index: int, cfg: TrainConfig) -> torch.Tensor:
    """The mean next-token loss of global batch ``index`` of ``source`` (validation: no MTP term)."""
    return _batch_losses(model, source, index, cfg, train=False)[0]


def _batch_losses(model: torch.nn.Module, source, index: int, cfg: TrainConfig, *, rows: tuple[int, int] | None = None,
                  train: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean next-token loss of global batch ``index`` of ``source`` (the training or validation corpus), or of its
    ``rows`` (first row, count), and, in training with MTP depths, their mean loss."""
    first, count = rows or (0, cfg.global_batch_size)
    positions = source.positions(index, first, first + count) if cfg.data.document_mask else None
    inputs, targets = model_batch(source.rows(index, first, first + count), positions)
    trained = source.loss_mask(index, first, first + count)
    if trained is not None:  # chat data: the mean over the batch's assistant targets (F.cross_entropy's rule)
        targets = targets.masked_fill(~trained, -100)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    hidden = model.hidden(*inputs)
    logits = model.logits(hidden)
    if cfg.data.no_loss_across_documents:  # no loss where the input token ends a document; mean over every position
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss = (losses * (inputs[0].flatten() != cfg.data.eod_token)).sum() / losses.numel()
    else:
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    depth = cfg.model.mtp_depth
    if not (train and depth):
        return loss, None
    return loss, _mtp_loss(model, hidden, inputs, targets, depth=depth, cfg=cfg)


def _mtp_loss(model: torch.nn.Module, hidden: torch.Tensor, inputs: tuple, targets: torch.Tensor, *, depth: int,
              cfg: TrainConfig) -> torch.Tensor:
    """(1/D) sum_k of depth k's summed loss over the positions i with a token t_{i+k+1} in the window, in the same
    document as t_i (packed documents), not following an end of document (--no-loss-across-documents), divided by
    every position of the batch (DeepSeek-V3 eq. 24-25)."""
    tokens, (b, t) = inputs[0], inputs[0].shape
    documents = inputs[2] if len(inputs) == 3 else None
    future = torch.zeros(b, t, depth, dtype=torch.long)
    for k in range(1, depth + 1):
        future[:, :t - k, k - 1] = tokens[:, k:]
    depth_logits = model.mtp(hidden, future, model.head, *inputs[1:])
    total = torch.zeros(())
    for k in range(1, depth + 1):
        keep = torch.zeros(b, t, dtype=torch.bool)
        keep[:, :t - k] = True
        if documents is not None:
            keep[:, :t - k] &= documents[:, k:] == documents[:, :t - k]
        if cfg.data.no_loss_across_documents:
            keep[:, :t - k] &= tokens[:, k:] != cfg.data.eod_token
        labels = torch.zeros(b, t, dtype=torch.long)
        labels[:, :t - k] = targets[:, k:]
        losses = F.cross_entropy(depth_logits[k - 1].flatten(0, 1), labels.flatten(), reduction="none")
        total = total + (losses * keep.flatten()).sum() / losses.numel()
    return total / depth


def _update_expert_biases(model: torch.nn.Module, *, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing after the optimizer step, on the global batch's loads."""
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        counts = layer.take_tokens_per_expert()
        bias = getattr(layer.router, "expert_bias", None)
        if rate > 0 and bias is not None and counts is not None:
            with torch.no_grad():
                bias.copy_(update_expert_bias(bias, counts, rate))
