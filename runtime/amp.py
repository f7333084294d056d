"""Mixed precision across pipeline stages.

fp16 needs loss scaling (Micikevicius et al. 2018): small gradients underflow in fp16, so the loss is
multiplied by a scale S before backward and gradients divided by S before the optimizer step. In a
pipeline only the last stage sees the loss, so the loss function the schedule calls returns
``scaler.scale(loss)``: every stage then back-propagates S-scaled gradients. Before the step, every
rank unscales its own gradients and the found-inf flags are all-reduced over the *whole world*, so
an overflow on any stage, replica or shard makes every rank skip the same step and halve S together.
bf16 has fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

# ShardedGradScaler hands a (1,)-shaped found-inf tensor to the unscale kernel alongside DTensor
# gradients; DTensor warns that it replicates it, which is exactly what we want.
warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def build_grad_scaler(precision: str, device_type: str, *, process_group=None) -> ShardedGradScaler:
    """Enabled only for fp16. ``process_group=None`` means the world: the found-inf vote spans every rank."""
    return ShardedGradScaler(device=device_type, enabled=precision == "fp16", process_group=process_group)


def ensure_scale_initialised(scaler: ShardedGradScaler, device: torch.device) -> None:
    """Ranks without the last stage never call ``scaler.scale``; give them a scale so ``unscale_`` works."""
    if scaler.is_enabled():
        scaler.scale(torch.ones((), device=device))


def scaled_cross_entropy(scaler: ShardedGradScaler):
    """The schedule's loss function: mean next-token cross-entropy of one micro-batch, loss-scaled.

    The schedule divides gradients by the number of micro-batches and FSDP averages over dp, so the
    per-micro-batch mean is what makes the step equal a single device on the global batch.
    """

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits (mb, T, V) may be fp16 under autocast; the loss is computed in fp32.
        loss = F.cross_entropy(rearrange(logits.float(), "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"))
        return scaler.scale(loss)

    return loss_fn
