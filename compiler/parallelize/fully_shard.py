"""Data parallelism with FSDP2 (``fully_shard``) over the mesh's dp dimension.

Each block of a stage is its own FSDP unit (so its parameters are gathered and freed as a group),
and the stage module is the root unit. Under pipelining the schedule decides when gradients are
reduced: every micro-batch's backward runs with gradient sync off, and one reduce-scatter per stage
happens after the last micro-batch (the schedule's REDUCE_GRAD action), i.e. once per step.
``reshard_after_forward=False`` keeps parameters gathered between a micro-batch's forward and its
backward, as torchtitan does under PP, instead of re-gathering them for every micro-batch.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from compiler.parallelize.tensor_parallel import block_names


def apply_fsdp(stage_module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    for name in block_names(stage_module):
        fully_shard(stage_module.get_submodule(name), mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)
    return stage_module


def maybe_apply_fsdp(stage_module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """FSDP only when there is more than one replica: with dp = 1 it would shard over a single rank."""
    return apply_fsdp(stage_module, dp_mesh) if dp_mesh.size() > 1 else stage_module
