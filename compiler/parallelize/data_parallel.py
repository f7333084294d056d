"""Data parallelism over the mesh's dp ranks with FSDP2 (``fully_shard``): fully sharded, hybrid
(HSDP) or replicated, by the shape of the data-parallel mesh it is given.

- 1-D mesh of the dp ranks: FSDP (ZeRO-3 layout). Parameters, gradients and optimizer state are
  sharded over all dp ranks; gradients are reduce-scattered.
- 2-D mesh (replicate, shard): HSDP (PyTorch's "hybrid shard", ZeRO++ hpZ-like): sharded within a
  group of ``shard`` ranks, replicated across the dp / shard groups; gradients are reduce-scattered in
  the shard group and all-reduced across groups.
Plain replication (a shard group of one, DDP's layout) does not go through FSDP: runtime/engine/replicate.py.

Each block of a stage is its own FSDP unit (gathered and freed as a group) and the stage module is the
root unit. Under pipelining the schedule decides when gradients are reduced: every micro-batch's
backward runs with gradient sync off and one reduction per unit happens after the last micro-batch
(the schedule's REDUCE_GRAD action), i.e. once per step. By default parameters stay gathered from the
first forward to the last backward (``reshard_after_forward=False``, as torchtitan does under PP)
instead of being re-gathered for every micro-batch; ``reshard_after_forward=True`` frees each unit's
gathered parameters after its forward and gathers them again for its backward (ZeRO-3's memory, paid
with an all-gather per micro-batch and unit). ``reduce_dtype`` communicates gradients in a lower
precision (FSDP's MixedPrecisionPolicy); parameters and optimizer state stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from compiler.parallelize.tensor_parallel import block_names


@dataclass(frozen=True)
class DataParallelOptions:
    reshard_after_forward: bool = False  # ZeRO-3: free gathered parameters after each forward
    reduce_dtype: torch.dtype | None = None  # gradient communication dtype; None: the parameters' (fp32)


def apply_data_parallel(stage_module: nn.Module, dp_mesh: DeviceMesh, options: DataParallelOptions) -> nn.Module:
    """Shard the stage over ``dp_mesh`` (see the module docstring)."""
    policy = MixedPrecisionPolicy(reduce_dtype=options.reduce_dtype)
    for name in block_names(stage_module):
        fully_shard(stage_module.get_submodule(name), mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=options.reshard_after_forward)
    fully_shard(stage_module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=options.reshard_after_forward)
    return stage_module
