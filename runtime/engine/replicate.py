"""Replicated data parallelism (``--dp-shard 1``): DDP's algorithm for a pipeline's micro-batches.

Every dp rank holds its whole stage and micro-batches accumulate gradients locally (DDP's ``no_sync``).
During the last micro-batch's backward the gradients are averaged over the dp group as they become
final, overlapping communication with the rest of the backward, as DDP's reducer does (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training"): parameters are grouped into
buckets of about 25 MB in reverse order (backward produces the last layers' gradients first), a hook
counts each parameter's accumulations, and a bucket whose gradients have all reached their last
accumulation is flattened and all-reduced asynchronously. ``finish`` waits for the buckets after the
schedule's step. Fewer, larger messages are what gloo (and NCCL) move fastest; FSDP's machinery for a
shard group of one costs more than it saves. Tensor-parallel parameters all-reduce their local shards:
dp peers hold the same shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 2**20


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class ReplicatedGradients:
    def __init__(self, params: list[nn.Parameter], *, group: dist.ProcessGroup, reduce_dtype: torch.dtype | None,
                 accumulations: int, deferred: set[int] = frozenset()):
        """``accumulations``: backward passes through every parameter per step (the micro-batches).
        ``deferred``: ids of parameters whose gradients change after the backward (a tied weight's copies,
        summed across stages by runtime/engine/tied.py): they are reduced only in ``finish``, after that."""
        distinct = list({id(p): p for p in params}.values())  # a tied weight once
        self.group, self.reduce_dtype, self.accumulations = group, reduce_dtype, accumulations
        self.size = dist.get_world_size(group)
        early = [p for p in distinct if id(p) not in deferred]
        self.buckets = _buckets(early[::-1]) + _buckets([p for p in distinct if id(p) in deferred])
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        for p in early:
            p.register_post_accumulate_grad_hook(self._on_accumulated)

    def _reset(self) -> None:
        self.counts = dict.fromkeys(self.bucket_of, 0)
        self.waiting = [len(bucket) for bucket in self.buckets]  # parameters not yet final, per bucket
        self.in_flight: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def _on_accumulated(self, param: nn.Parameter) -> None:
        self.counts[id(param)] += 1
        if self.counts[id(param)] == self.accumulations:
            bucket = self.bucket_of[id(param)]
            self.waiting[bucket] -= 1
            if self.waiting[bucket] == 0:
                self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        grads = [_local(p.grad) for p in self.buckets[bucket] if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1).to(self.reduce_dtype or g.dtype) for g in grads])
            self.in_flight[bucket] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self) -> None:
        """After the step's backward: reduce any bucket not launched yet, wait for all, write the averages
        back into the gradients."""
        for bucket in range(len(self.buckets)):
            if bucket not in self.in_flight:
                self._launch(bucket)
        for bucket, (flat, work) in sorted(self.in_flight.items()):
            work.wait()
            flat.div_(self.size)
            offset = 0
            for g in (_local(p.grad) for p in self.buckets[bucket] if p.grad is not None):
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._reset()


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype, each bucket at most ``BUCKET_BYTES`` (or one larger parameter)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        local = _local(p)
        nbytes = local.numel() * local.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
