"""AdamW with linear warm-up then cosine decay to a tenth of the peak rate."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Device types torch has a fused AdamW kernel for, in 2.11 and 2.13 alike (torch/optim/adam.py), among those
# this engine runs on.
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def build_optimizer(params: list[nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Weight decay on matrices only; biases, norms stay undecayed (as in GPT-2 / nanoGPT).

    The update runs fused (one pass over each tensor) where every parameter is on a device in
    ``FUSED_ADAMW_DEVICES``, else as ``foreach`` multi-tensor kernels (~10 passes over memory; a per-parameter
    loop would add ~10 kernel launches per parameter). On a CPU core the fused kernel is several times faster
    than foreach. Both kernels take one list of tensors of one kind: all plain, or
    all DTensors (on a mesh that DTensor's foreach and fused strategies resolve per list). A stage under TP
    mixes plain tensors (layer norms, the position embedding) with DTensors on the mp mesh, or, under FSDP
    too, DTensors on the dp mesh with DTensors on the (dp, mp) mesh; so each kind gets a parameter group of
    its own, with the same settings (``layout_groups``). The update of every parameter is the same as in one
    group.
    """
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": group, "weight_decay": wd}
              for members, wd in ((decay, weight_decay), (no_decay, 0.0))
              for group in layout_groups(members)]
    fusable = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES for p in params)
    kernels = {"fused": True} if fusable else {"foreach": True}
    return torch.optim.AdamW(groups or [{"params": []}], lr=lr, betas=(0.9, 0.95), **kernels)


def layout_groups(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` split by kind, in first-seen order: plain tensors together, DTensors by device mesh."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        key = ("dtensor", p.device_mesh) if isinstance(p, DTensor) else ("plain", p.device)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_lr_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=total_steps)
    )
