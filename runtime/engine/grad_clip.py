"""Gradient-norm clipping over the whole model: every stage, every dp shard, every mp shard.

A per-stage clip would scale each stage by a different factor and change the update direction, so
the norm must be global. Each rank sums the squares of its local gradient pieces, weighting every
piece by 1 / (number of ranks holding an identical copy), and one SUM all-reduce over the world
gives the squared norm of the full gradient:
- FSDP shards over dp and TP shards over mp hold disjoint pieces (weight 1 per distinct shard);
- a parameter replicated over mp (layer norms, embeddings, head) is counted once, not mp times;
- pipeline stages hold disjoint parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from compiler.torch_compat import StridedShard, foreach_mul_, foreach_norm


def _local_and_copies(grad: torch.Tensor, plane_size: int) -> tuple[torch.Tensor, int]:
    """(local piece, number of ranks in this stage's dp x mp plane holding the same piece)."""
    if isinstance(grad, DTensor):
        distinct = 1
        for dim, placement in enumerate(grad.placements):
            if isinstance(placement, (Shard, StridedShard)):  # StridedShard: FSDP over a TP shard
                distinct *= grad.device_mesh.size(dim)
        return grad.to_local(), plane_size // distinct
    return grad, plane_size


def local_grad_sq_norm(params: list[nn.Parameter], *, plane_size: int) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64 scalar).

    A SUM all-reduce of the shares over the world gives ||g||^2 of the full model gradient;
    ``plane_size`` is dp x mp, the ranks sharing one pipeline stage.
    """
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local, copies = _local_and_copies(p.grad, plane_size)
            by_copies.setdefault(copies, []).append(local.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for copies, grads in by_copies.items():
        # Per-tensor fp32 norms in one fused pass (as clip_grad_norm_ does), summed in fp64.
        norms = foreach_norm(grads)
        total += torch.stack(norms).double().pow(2).sum() / copies
    return total


def clip_grads_(params: list[nn.Parameter], *, max_norm: float, total_norm: float) -> None:
    """Scale gradients in place so the global norm is at most ``max_norm`` (no-op if it is not finite)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        if local:  # a stage may train nothing (LoRA's frozen embedding alone on its stage)
            foreach_mul_(local, coef)
