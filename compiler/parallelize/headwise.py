"""A per-head module under tensor parallelism (models/spec.py ``HEADWISE``): gpt-oss's attention sinks.

Column-parallel q gives each mp rank n_heads/mp query heads; a module whose parameter holds one value per head (the
sinks, (H,)) must then hold the same heads' values: its parameters are sharded on dim 0 over mp (a DTensor,
Shard(0), as a column-parallel bias is), its inputs, this rank's heads (B, H/mp, ...), enter as Shard(1) DTensors and
its output leaves as this rank's local heads. Forward and backward need no communication: each head's gradient is
its own rank's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

HEADS_DIM = 1  # activations are (B, heads, ...)


class HeadwiseParallel(ParallelStyle):
    """Parameters Shard(0) with the heads, floating-point inputs this rank's heads (Shard(1)), output local."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_heads(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                # src_data_rank=None: no broadcast; materialisation fills each rank's heads (compiler/parallelize/
                # materialize.py)
                sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
                mod.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

        def heads_in(_mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(a, mesh, [Shard(HEADS_DIM)], run_check=False)
                         if isinstance(a, torch.Tensor) and a.is_floating_point() and not isinstance(a, DTensor) else a
                         for a in args)

        def local_out(_mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, shard_heads, input_fn=heads_in, output_fn=local_out)
