"""Gradients left as partial sums over tensor-parallel ranks, summed before anything reads them.

Under sequence parallelism the norms' weights (and biases) are replicated over mp while each mp rank computes
on its own T/mp tokens, so DTensor leaves their gradients ``Partial(sum)``: each rank holds its shard's share.
FSDP2 reduces such gradients with its own reduce-scatter; without FSDP (dp 1, or ``--dp-shard 1``) nothing
does, and the gradient norm, clipping and AdamW would each read one rank's share (AdamW's update nearly
hides it: its first step moves a weight by about lr * sign(g)). Megatron-LM sums these gradients over the
tensor-parallel group after the backward (``allreduce_sequence_parallel_grads`` / its layernorm
all-reduce); here likewise, one all-reduce per mesh for all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def sum_partial_gradients(params: list[nn.Parameter]) -> int:
    """Make every ``Partial`` gradient among ``params`` its parameter's placement (the sum over the partial mesh
    dimensions), flattened into one all-reduce per (mesh, placements); returns the number of gradients summed.
    Peers of a mesh hold the same stages, so they reach the same buckets in the same order (NCCL-safe)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(p)
    for (mesh, placements), group in groups.items():
        if any(not (pl.is_partial() or pl.is_replicate()) for pl in placements):
            for p in group:  # a partial sum beside a shard: rare, left to DTensor's own redistribution
                p.grad = p.grad.redistribute(placements=p.placements)
            continue
        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for p, local in zip(group, locals_):
            summed = flat[offset:offset + local.numel()].view_as(local)
            offset += local.numel()
            p.grad = DTensor.from_local(summed, mesh, p.placements, run_check=False)
    return sum(len(group) for group in groups.values())
