"""Tied input/output embeddings across pipeline stages (Megatron-LM's "embedding group").

GPT-2's LM head reuses the token-embedding matrix. A pipeline puts the embedding on the first stage and
the head on the last, usually on different ranks, so each keeps a copy of the [V, D] weight,
initialised alike. A shared weight's gradient is the sum of its two uses, so after backward the two
copies' gradients are summed (an all-reduce over the pair of ranks that hold them, or a local add
where one rank holds both) and the optimizer then moves both copies identically: they stay equal, and
training equals that of the tied model. The copies are sharded alike (FSDP over dp, vocabulary over
mp), so each rank sums local shards element by element with its partner's.

Where one stage holds both the embedding and the head (a single pipeline stage), they share one
Parameter instead. The head's copy counts once in the gradient norm: ``duplicates`` names it so the
norm skips it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.gpt import TIED_WEIGHTS
from runtime.distributed.mesh import GridLayout


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class TiedWeights:
    """The copies of a tied weight on this rank, and the group of ranks that holds the other copy."""

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], *, layout: GridLayout, rank: int,
                 first_pp: int, last_pp: int, timeout: datetime.timedelta):
        """``first_pp`` / ``last_pp``: the pp ranks holding the first and last stage; ``timeout`` bounds the
        pairs' all-reduces (--collective-timeout). Collective: every rank calls it, since every rank creates
        every pair's process group."""
        names = dict(named_parameters)
        # A stage holding both ends shares one Parameter between them (compiler/parallelize/stages.py):
        # nothing to sum or to discount then.
        separate = {copy: source for copy, source in TIED_WEIGHTS.items()
                    if copy not in names or names.get(source) is not names[copy]}
        self.copies = [names[n] for pair in separate.items() for n in pair if n in names]
        self.duplicates = {id(names[copy]) for copy in separate if copy in names}
        self.group = None
        if first_pp != last_pp:
            for d in range(layout.dp):
                for m in range(layout.mp):
                    pair = [layout.rank(d, first_pp, m), layout.rank(d, last_pp, m)]
                    group = dist.new_group(pair, timeout=timeout)
                    if rank in pair:
                        self.group = group

    def sync_grads(self) -> None:
        """Sum the copies' gradients so both hold the shared weight's gradient. Every rank of a pair must
        call it after the same backward; ranks holding no copy do nothing."""
        grads = [_local(_as_param_placed(p)) for p in self.copies if p.grad is not None]
        if not grads:
            return
        if len(grads) == 2:  # both copies here (one pipeline stage, or a V-shaped placement)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif self.group is not None:
            dist.all_reduce(grads[0], group=self.group)


def _as_param_placed(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient laid out like the parameter. DTensor's vocabulary-parallel embedding
    backward returns the weight's gradient replicated over mp (every rank computes all V rows); the
    head's is sharded like its weight. Exchanging shards needs both in the weight's layout (a local
    slice of a replicated gradient: no communication)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)
    return param.grad
