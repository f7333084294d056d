"""Replicated modules inside a tensor-parallel region: multi-head latent attention's (models/common/latent_attention.py).

Between a block's input and its column-parallel matrices, every mp rank computes the same values; after them,
each rank holds its own heads. Gradients coming back from the heads are therefore each rank's part of a sum, and a
replicated computation that feeds the heads must add those parts up before its own backward (Megatron's "f":
identity forward, all-reduce backward). Column-parallel linears do it for their input; multi-head latent attention
has one tensor that reaches the heads without one, the RoPE key every head shares:

- ``HEAD_SHARED`` (``SumGradientOverHeads``): a parameter-free module whose input, the same on every rank, feeds
  this rank's heads: forward unchanged, backward all-reduced over mp (DTensor: the local value marked Replicate,
  its gradient taken as Partial, and reduced to Replicate);
- ``REPLICATED`` (``ReplicatedLinear``): under sequence parallelism the attention's input arrives all-gathered as a
  Replicate DTensor (compiler/parallelize/sequence_parallel.py ``GatherSequence``); a replicated linear layer that
  takes it (the latent down projections ``q_a``, ``kv_a``) holds its weight as a Replicate DTensor too and hands a
  plain tensor on. Its output's gradient is the same on every rank (what follows sums its heads' parts: the
  column-parallel ``q`` / ``kv_b`` and ``HEAD_SHARED``), so the output is returned with a Replicate gradient, and
  the input's gradient (Replicate) reaches the gather, whose backward keeps this rank's sequence shard of it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


def _is_activation(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class SumGradientOverHeads(ParallelStyle):
    """Identity forward on the module's floating-point inputs; their gradients summed over the mp ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def mark(_module: nn.Module, args: tuple):
            return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()]) if _is_activation(a) and not isinstance(a, DTensor) else a for a in args)

        module.register_forward_pre_hook(mark)
        return module


class ReplicatedLinear(ParallelStyle):
    """A linear layer replicated over mp that takes a Replicate DTensor (or a plain tensor, the same on every rank):
    weight Replicate, output local with a Replicate gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def as_replicate(_module: nn.Module, args: tuple, mesh: DeviceMesh):
            return tuple((a.redistribute(mesh, [Replicate()]) if isinstance(a, DTensor) else
                          DTensor.from_local(a, mesh, [Replicate()], run_check=False)) if _is_activation(a) else a
                         for a in args)

        def to_local(_module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, None, input_fn=as_replicate, output_fn=to_local)
