"""Tied input/output embeddings across pipeline stages (Megatron-LM's "embedding group").

GPT-2's LM head reuses the token-embedding matrix. A pipeline puts the embedding on the first stage and
the head on the last, usually on different ranks, so each keeps a copy of the [V, D] weight,
initialised alike. A shared weight's gradient is the sum of its two uses, so after backward the two
copies' gradients are summed (exchanged between the pair of ranks that hold them, or a local add
where one rank holds both) and the optimizer then moves both copies identically: they stay equal, and
training equals that of the tied model. The copies are sharded alike (FSDP over dp, vocabulary over
mp), so each rank sums local shards element by element with its partner's.

Where one stage holds both the embedding and the head (a single pipeline stage), they share one
Parameter instead. The head's copy counts once in the gradient norm: ``duplicates`` names it so the
norm skips it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor



def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class TiedWeights:
    """The copies of a tied weight on this rank, and where the other copy is."""

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], *, tied_weights: dict[str, str],
                 pp_group: dist.ProcessGroup | None, pp_rank: int, first_pp: int, last_pp: int):
        """``tied_weights``: {copy: source} names (the model family's). ``first_pp`` / ``last_pp``: the pp ranks
        holding the first and last stage; ``pp_group``: this rank's pipeline group (ranks of its dp and mp
        coordinates, by pp rank), which holds both. The pair exchanges its gradients point to point over that
        group, so no group of its own is made: creating dp x mp pair groups took dp x mp world-wide
        ``new_group`` calls on every rank, and each pair's group would be one more communicator to bound by the
        collective timeout."""
        names = dict(named_parameters)
        # A stage holding both ends shares one Parameter between them (compiler/parallelize/stages.py):
        # nothing to sum or to discount then.
        separate = {copy: source for copy, source in tied_weights.items()
                    if copy not in names or names.get(source) is not names[copy]}
        self.copies = [names[n] for pair in separate.items() for n in pair if n in names]
        self.duplicates = {id(names[copy]) for copy in separate if copy in names}
        self.group = pp_group
        # The pp rank holding the other copy, when it is another rank.
        self.peer = None if first_pp == last_pp else {first_pp: last_pp, last_pp: first_pp}.get(pp_rank)

    def sync_grads(self) -> None:
        """Sum the copies' gradients so both hold the shared weight's gradient. Both ranks of a pair call it
        after the same backward, whether or not their copy got a gradient (a missing one counts as zeros:
        a rank that skipped the exchange would leave its partner waiting); ranks holding no copy do nothing."""
        if not self.copies:
            return
        grads = [_local(_grad_placed_like(p)) for p in self.copies]
        if len(grads) == 2:  # both copies here (one pipeline stage, or a V-shaped placement)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif self.peer is not None:
            # Batched, so that NCCL posts the send and the receive together (two blocking p2p kernels, each
            # waiting for the other rank's second one, would deadlock). a + b == b + a in floating point:
            # both copies end bit-identical, as after an all-reduce of the pair.
            received = torch.empty_like(grads[0])
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, grads[0], group=self.group, group_peer=self.peer),
                                                dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.peer)]):
                work.wait()
            grads[0].add_(received)


def _grad_placed_like(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient laid out like the parameter; zeros when the copy got none."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return _as_param_placed(param)


def _as_param_placed(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient laid out like the parameter, as exchanging shards needs. Both copies'
    gradients arrive that way under mp: the vocabulary-parallel embedding (compiler/parallelize/
    vocab_parallel.py) computes the gradient of its own rows only, Shard(0) over mp like its weight (checked
    on 2 gloo ranks: a [V/mp, D] local gradient), and the head's is sharded like its weight. The redistribute
    guards a style whose backward returns another layout (DTensor's stock RowwiseParallel embedding returns
    the whole table's gradient, replicated: slicing that locally needs no communication)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)
    return param.grad
