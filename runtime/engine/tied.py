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
norm skips it. Multi-token prediction (models/common/mtp.py) adds a second copy of the embedding on the last
stage, handled alike: the last stage sums its two copies' gradients before the exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from compiler.torch_compat import bounded_p2p_works


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class TiedWeights:
    """The copies of the tied weights on this rank, and where the other copies are."""

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], *, tied_weights: dict[str, str],
                 pp_group: dist.ProcessGroup | None, pp_rank: int, first_pp: int, last_pp: int):
        """``tied_weights``: {copy: source} names (models.tied_weights: a tied head's, the MTP depths' embedding's;
        a source may have several copies). ``first_pp`` / ``last_pp``: the pp ranks holding the first and last
        stage; ``pp_group``: this rank's pipeline group (ranks of its dp and mp coordinates, by pp rank), which
        holds both. The source lives on the first stage and its copies on the last, so the pair of ranks exchanges
        gradients point to point over that group and no group of its own is made: creating dp x mp pair groups
        took dp x mp world-wide ``new_group`` calls on every rank, and each pair's group would be one more
        communicator to bound by the collective timeout."""
        names = dict(named_parameters)
        self.group = pp_group
        # The pp rank holding the other copies, when it is another rank.
        self.peer = None if first_pp == last_pp else {first_pp: last_pp, last_pp: first_pp}.get(pp_rank)
        copies_of: dict[str, list[str]] = {}
        for copy, source in tied_weights.items():
            copies_of.setdefault(source, []).append(copy)
        # Per source, its distinct Parameters here: a stage holding several names of one weight shares one
        # Parameter between them (compiler/parallelize/stages.py), nothing to sum or to discount then.
        self.groups: list[list[nn.Parameter]] = []
        for source, copies in copies_of.items():
            held: list[nn.Parameter] = []
            for name in (source, *copies):
                if name in names and all(names[name] is not p for p in held):
                    held.append(names[name])
            if len(held) > 1 or (held and self.peer is not None):
                self.groups.append(held)
        self.copies = [p for group in self.groups for p in group]  # their gradients change after the backward
        sources = {id(names[source]) for source in copies_of if source in names}
        self.duplicates = {id(p) for p in self.copies if id(p) not in sources}  # counted once in the grad norm

    def sync_grads(self) -> None:
        """Sum the copies' gradients so every copy holds the shared weight's gradient. Both ranks of a pair call it
        after the same backward, whether or not their copies got a gradient (a missing one counts as zeros: a rank
        that skipped the exchange would leave its partner waiting); ranks holding no copy do nothing."""
        for group in self.groups:
            grads = [_local(_grad_placed_like(p)) for p in group]
            total = grads[0]
            for grad in grads[1:]:  # copies on this rank (one pipeline stage, a V-shaped placement, the last stage)
                total.add_(grad)
            if self.peer is not None:
                # Batched, so that NCCL posts the send and the receive together (two blocking p2p kernels, each
                # waiting for the other rank's second one, would deadlock). a + b == b + a in floating point:
                # every copy ends bit-identical, as after an all-reduce of the pair.
                received = torch.empty_like(total)
                ops = [dist.P2POp(dist.isend, total, group=self.group, group_peer=self.peer),
                       dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.peer)]
                for work in bounded_p2p_works(dist.batch_isend_irecv(ops), ops):  # within the phase's timeout
                    work.wait()
                total.add_(received)
            for grad in grads[1:]:
                grad.copy_(total)


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
