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
from collections import defaultdict

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from compiler.parallelize.cross_entropy import token_cross_entropy, vocabulary_shard
from compiler.precisions import PRECISIONS
from compiler.torch_compat import MultiDeviceReplicator, non_finite_check_and_unscale_, replicated_tensors
from runtime.engine.mtp_loss import MtpObjective


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    return PRECISIONS[precision].autocast(device_type)


class LocalShardGradScaler(ShardedGradScaler):
    """ShardedGradScaler that checks and unscales each rank's *local* gradient shards.

    The stock scaler runs its unscale kernel on DTensor gradients, which makes DTensor all-reduce a
    found-inf flag over every sub-mesh a gradient lives on (dp, mp, or both), before ``unscale_``
    all-reduces it over the world anyway. Each rank's local shards are exactly its share of the
    gradient, so one world-wide vote (in ``unscale_``) is enough.

    The flags are 0-d, as ``GradScaler``'s are: ``ShardedGradScaler.unscale_`` makes them of shape [1], and a
    fused optimizer (AdamW on CUDA) subtracts the flag from its 0-d step counts in place, which fails with
    "output with shape [] doesn't match the broadcast shape [1]" (pytorch issue 140514).
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        found_inf = found_inf.reshape(())
        per_device_inv_scale = MultiDeviceReplicator(inv_scale)
        per_device_found_inf = MultiDeviceReplicator(found_inf)
        grouped: dict = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    grouped[grad.device][grad.dtype].append(grad)
            for device, per_dtype in grouped.items():
                for grads in per_dtype.values():
                    non_finite_check_and_unscale_(grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        found = replicated_tensors(per_device_found_inf)
        if not found:
            per_device_found_inf.get(self._scale.device)
        return found


def build_grad_scaler(precision: str, device_type: str) -> ShardedGradScaler:
    """Enabled where the precision needs loss scaling (fp16). Its process group is the world: the found-inf
    vote spans every rank."""
    return LocalShardGradScaler(device=device_type, enabled=PRECISIONS[precision].loss_scaling)


def ensure_scale_initialised(scaler: ShardedGradScaler, device: torch.device) -> None:
    """Ranks without the last stage never call ``scaler.scale``; give them a scale so ``unscale_`` works."""
    if scaler.is_enabled():
        scaler.scale(torch.ones((), device=device))


def scaled_cross_entropy(scaler: ShardedGradScaler, *, microbatches: int, vocab_mesh: DeviceMesh | None = None,
                         vocab_size: int | None = None, over_every_position: bool = False,
                         mtp: MtpObjective | None = None):
    """The schedule's loss function: next-token cross-entropy of one micro-batch, divided by the
    number of micro-batches and loss-scaled.

    Summed over the micro-batches (gradient accumulation) and averaged over dp by FSDP, that is the
    gradient of the mean loss on the global batch, as on a single device. Dividing the loss, not the
    gradients, saves a pass over every gradient; ``loss_value`` undoes both factors for logging.

    The loss is computed in fp32 over chunks of tokens, without an fp32 copy of the logits (which may be
    bf16 or fp16 under autocast; compiler/parallelize/cross_entropy.py). With ``vocab_mesh`` the logits are
    this rank's vocabulary shard (mb, T, V/mp) of a vocabulary-parallel head, and the softmax's statistics
    are all-reduced over the mp group, never gathering the (mb, T, V) logits.

    ``over_every_position`` (targets with ``IGNORE_INDEX``: --no-loss-across-documents): the sum of the token
    losses over the micro-batch's mb x T positions, an ignored one counting zero. Every micro-batch and rank then
    has the same denominator, so the gradient is the same on any mesh; a mean over each micro-batch's own
    unignored tokens would weigh micro-batches by how many they hold.

    ``mtp``: the multi-token-prediction objective of this rank's last stage (runtime/engine/mtp_loss.py); the loss
    function then takes the stage's (logits, h^0) and the stacked targets.
    """
    shard = vocabulary_shard(vocab_mesh, vocab_size) if vocab_mesh is not None else None

    def next_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if over_every_position:
            return token_cross_entropy(logits, targets, shard=shard, reduction="sum") / targets.numel()
        return token_cross_entropy(logits, targets, shard=shard)

    def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
        loss = mtp.loss(output, targets, next_token) if mtp is not None else next_token(output, targets)
        return scaler.scale(loss / microbatches)

    return loss_fn


def loss_value(scaled_losses: list[torch.Tensor], *, scale: float) -> torch.Tensor:
    """Mean unscaled loss of a replica's micro-batches, from what ``scaled_cross_entropy`` returned."""
    # sum over m of (loss / m) * scale = mean loss * scale
    return torch.stack(scaled_losses).detach().double().sum() / scale
