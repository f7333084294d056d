"""Replicated data parallelism (``--dp-shard 1``): DDP's algorithm for a pipeline's micro-batches.

Every dp rank holds its whole stage and micro-batches accumulate gradients locally (DDP's ``no_sync``).
During the last micro-batch's backward the gradients are averaged over the dp group as they become
final, overlapping communication with the rest of the backward, as DDP's reducer does (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training"): parameters are grouped into
buckets of about 25 MB in reverse order (backward produces the last layers' gradients first), a hook
counts each parameter's accumulations, and once a bucket's gradients have all reached their last
accumulation it is flattened, divided by the dp size and all-reduced (sum) asynchronously. ``finish``
waits for the buckets after the schedule's step. Fewer, larger messages are what gloo (and NCCL) move
fastest. Tensor-parallel parameters all-reduce their local shards: dp peers hold the same shard.

Buckets are launched strictly in bucket order, as DDP's reducer does: a ready bucket waits for every
earlier one. Ranks can finish gradients in different orders, and NCCL pairs collectives by their order on
each rank; launched in readiness order, two ranks could reduce different buckets together (a size
mismatch or a hang). Dividing before the sum, not after, keeps a reduction in fp16 (``--reduce-dtype``)
from overflowing dp-fold sooner than the gradients themselves.

Split-backward schedules (zero-bubble, zbv, dualpipev) compute weight gradients with
``torch.autograd.grad`` and add them to ``.grad`` themselves, which fires no accumulate hook; so each
stage's weight pass (``backward_weight_one_chunk``) counts as one accumulation of every parameter of the
stage that no hook reported during it, and their buckets overlap with the rest of the schedule too. A stage whose
weight pass is empty (the last stage with two MTP depths or more: compiler/parallelize/stages.py) runs a plain
backward in its input pass, which the hooks count; counting its weight pass too would count every micro-batch twice.

Why not torch's own: DDP's reducer is driven by the same hooks (the weight passes of split schedules would
never reach it) and takes tensor-parallel DTensor parameters only through a private transform. FSDP2 on a
shard group of one orders its reductions by construction and handles split schedules (one reduction per
unit after the last weight pass), but it skips only the all-gather: every unshard still copies each
parameter into an unsharded buffer, held beside the one-rank "shard" for the step (the parameters twice,
in the mode meant to hold them once); this path measured 1.0x of a plain DDP loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from compiler.torch_compat import weight_pass_is_empty

BUCKET_BYTES = 25 * 2**20


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class ReplicatedGradients:
    def __init__(self, params: list[nn.Parameter], *, group: dist.ProcessGroup, reduce_dtype: torch.dtype | None,
                 accumulations: int, deferred: set[int] = frozenset(), stages: list = ()):
        """``accumulations``: backward passes through every parameter per step (the micro-batches).
        ``deferred``: ids of parameters whose gradients change after the backward (a tied weight's copies,
        summed across stages by runtime/engine/tied.py): they are reduced only in ``finish``, after that.
        ``stages``: this rank's PipelineStages, whose weight passes are counted (see the module docstring)."""
        distinct = list({id(p): p for p in params}.values())  # a tied weight once
        self.group, self.reduce_dtype, self.accumulations = group, reduce_dtype, accumulations
        self.size = dist.get_world_size(group)
        early = [p for p in distinct if id(p) not in deferred]
        self.buckets = _buckets(early[::-1]) + _buckets([p for p in distinct if id(p) in deferred])
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        for p in early:
            p.register_post_accumulate_grad_hook(self._on_accumulated)
        hooked = {id(p) for p in early}
        for stage in stages:
            if not weight_pass_is_empty(stage):  # else its input pass ran the whole backward, which hooks report
                _count_weight_passes(stage, [p for p in stage.submod.parameters() if id(p) in hooked], self)

    def _reset(self) -> None:
        self.counts = dict.fromkeys(self.bucket_of, 0)
        self.waiting = [len(bucket) for bucket in self.buckets]  # parameters not yet final, per bucket
        self.next_bucket = 0  # buckets below it are launched
        self.in_flight: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def _on_accumulated(self, param: nn.Parameter) -> None:
        self.counts[id(param)] += 1
        if self.counts[id(param)] == self.accumulations:
            self.waiting[self.bucket_of[id(param)]] -= 1
            while self.next_bucket < len(self.buckets) and self.waiting[self.next_bucket] == 0:
                self._launch(self.next_bucket)

    def _launch(self, bucket: int) -> None:
        self.next_bucket = bucket + 1
        grads = [_local(p.grad) for p in self.buckets[bucket] if p.grad is not None]
        if grads:
            # The average: each rank's share divided first (in the gradients' dtype), then summed.
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.size)
            flat = flat.to(self.reduce_dtype or flat.dtype)
            self.in_flight[bucket] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self) -> None:
        """After the step's backward: reduce the buckets not launched yet (in order), wait for all, write the
        averages back into the gradients."""
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket)
        for bucket, (flat, work) in sorted(self.in_flight.items()):
            work.wait()
            offset = 0
            for g in (_local(p.grad) for p in self.buckets[bucket] if p.grad is not None):
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._reset()


def _count_weight_passes(stage, params: list[nn.Parameter], replicated: ReplicatedGradients) -> None:
    """Make each of ``stage``'s weight passes count one accumulation of the ``params`` no hook reported during
    it (a split schedule's ``torch.autograd.grad``; the first stage's weight pass runs a plain backward,
    whose hooks do report)."""
    weight_pass = stage.backward_weight_one_chunk

    def counted(*args, **kwargs):
        before = [replicated.counts[id(p)] for p in params]
        result = weight_pass(*args, **kwargs)
        for p, count in zip(params, before):
            if replicated.counts[id(p)] == count and p.grad is not None:
                replicated._on_accumulated(p)
        return result

    stage.backward_weight_one_chunk = counted


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
