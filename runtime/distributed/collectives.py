"""Small agreements between ranks, over the default (world) process group: every rank calls them at the
same point. Each works in a lone process without a process group too."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order."""
    if not dist.is_initialized():
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_objects(obj, *, dst: int, group: dist.ProcessGroup | None = None) -> list | None:
    """Every rank's ``obj`` in rank order on rank ``dst`` (None elsewhere): one copy of each, not one per rank
    as an all-gather would leave. ``group`` (over every rank; default the world's) carries the pickles: a
    gloo group keeps them in host memory where the world's backend is NCCL."""
    if not dist.is_initialized():
        return [obj]
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def gather_lists(items: list) -> list:
    """The concatenation of every rank's list, in rank order."""
    return [x for part in all_gather_objects(items) for x in part]


def broadcast_object(obj, src: int = 0):
    """``src``'s ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
