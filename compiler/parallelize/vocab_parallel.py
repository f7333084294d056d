"""Megatron-LM's vocabulary-parallel embedding (Shoeybi et al. 2019, sec. 3), as a DTensor parallel style.

mp rank r holds rows [offset_r, offset_r + V_r) of the [V, D] table (a DTensor sharded on dim 0, so
checkpoints reshard it like any other parameter). It looks up the tokens that fall in its rows, zeros
the others, and the ranks' partial embeddings are summed (one all-reduce; backward passes the gradient
through unchanged, since every rank's part contributes to the sum). Written out rather than using
DTensor's ``RowwiseParallel`` on ``nn.Embedding``: that one's backward returns the whole [V, D] table's
gradient on every rank, V/mp times what the rank's shard needs.

Under sequence parallelism, when nothing is added to the token embeddings before the first block, the partial
sums are reduce-scattered over the sequence instead (``scatter_sequence``, set by
compiler/parallelize/sequence_parallel.py): each rank gets its (B, T/mp, D) shard of the residual stream.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from compiler.parallelize.sequence_parallel import reduce_scatter_sequence
from compiler.torch_compat import compute_local_shape_and_global_offset


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group; backward: the gradient as it is (Megatron's "g")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _forward(self: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    # tokens (B, T), the same on every mp rank; the local table (V_r, D) holds rows [offset, offset + V_r).
    table = self.weight.to_local()
    _, (offset, _) = compute_local_shape_and_global_offset(self.weight.shape, self.weight.device_mesh,
                                                           self.weight.placements)
    local = tokens - offset
    outside = (local < 0) | (local >= table.shape[0])
    partial = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)
    if self.scatter_sequence:
        return reduce_scatter_sequence(partial, self.weight.device_mesh)  # (B, T/mp, D)
    return _SumOverRanks.apply(partial, self.weight.device_mesh.get_group())  # (B, T, D)


class VocabParallelEmbedding(ParallelStyle):
    """Shard an ``nn.Embedding``'s rows over a 1-D mesh and look tokens up as described above."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, not {type(module).__name__}")
        # src_data_rank=None: no broadcast; every rank holds (or will compute) the same values.
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None))
        module.forward = types.MethodType(_forward, module)
        module.scatter_sequence = False
        return module
