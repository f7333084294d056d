"""AdamW with linear warm-up then cosine decay to a tenth of the peak rate."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(params: list[nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Weight decay on matrices only; biases, norms stay undecayed (as in GPT-2 / nanoGPT)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: a rank's parameters mix plain tensors and DTensors on different sub-meshes,
    # which the multi-tensor kernels cannot group.
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=False)


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_lr_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=total_steps)
    )
