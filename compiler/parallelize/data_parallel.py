"""Data parallelism over the mesh's dp ranks with FSDP2 (``fully_shard``): fully sharded, hybrid
(HSDP) or replicated, by the shape of the data-parallel mesh it is given.

- 1-D mesh of the dp ranks: FSDP (ZeRO-3 layout). Parameters, gradients and optimizer state are
  sharded over all dp ranks; gradients are reduce-scattered.
- 2-D mesh (replicate, shard): HSDP (PyTorch's "hybrid shard", ZeRO++ hpZ-like): sharded within a
  group of ``shard`` ranks, replicated across the dp / shard groups; gradients are reduce-scattered in
  the shard group and all-reduced across groups.
Plain replication (a shard group of one, DDP's layout) does not go through FSDP: runtime/engine/replicate.py.

Each block of a stage is its own FSDP unit (gathered and freed as a group), so is each MTP depth's block on the last
stage, and the stage module is the root unit: it holds the rest of the depths (the embedding's copy, which a single
stage shares with the embedding, norms, projections), which the loss function uses after the stage's forward, while
the root's parameters stay gathered (FSDP never reshards the root after forward). Under pipelining the schedule decides when
gradients are reduced: torch's PipelineStage runs every micro-batch's backward with gradient sync off and gathered
parameters kept, and reduces once per unit after the last micro-batch (its REDUCE_GRAD action), i.e. once per step,
as torchtitan does. That saves communication and keeps, for the whole step, the gathered parameters and unsharded
gradients.

``zero3`` keeps every rank's memory at its shards (ZeRO stage 3, Rajbhandari et al. 2020): parameters
are freed after each unit's forward and after its backward and gathered again when needed, and gradients
are reduce-scattered after every micro-batch's backward and accumulated as shards: one all-gather for
forward and one for backward, and one reduce-scatter, per micro-batch and unit.

``param_dtype`` gathers parameters in the autocast dtype (bf16 / fp16) and computes the stage in it,
FSDP's mixed precision (as torchtitan trains): the gathered copies use half the bytes, autocast keeps no
cast copy, and the residual stream inside a stage is low-precision too; the sharded parameters,
gradients and optimizer state stay fp32. ``reduce_dtype`` is the dtype gradients are communicated in (FSDP's
MixedPrecisionPolicy; fp32 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from compiler.parallelize.expert_parallel import MoeMeshes, moe_modules
from compiler.parallelize.tensor_parallel import block_names


@dataclass(frozen=True)
class DataParallelOptions:
    zero3: bool = False  # keep parameters and gradients sharded between uses, every micro-batch
    param_dtype: torch.dtype | None = None  # dtype parameters are gathered and computed in; None: fp32
    reduce_dtype: torch.dtype | None = None  # gradient communication dtype; None: fp32


def apply_data_parallel(stage_module: nn.Module, dp_mesh: DeviceMesh | None, options: DataParallelOptions, *,
                        moe: MoeMeshes | None = None) -> nn.Module:
    """Shard the stage over ``dp_mesh`` (see the module docstring); None: only its MoE layers (``moe``)."""
    reduce_dtype = options.reduce_dtype or torch.float32
    policy = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=reduce_dtype)
    if moe is not None:
        apply_moe_data_parallel(stage_module, moe, policy=policy, zero3=options.zero3)
    if dp_mesh is None:
        return stage_module
    for name in block_names(stage_module):
        fully_shard(stage_module.get_submodule(name), mesh=dp_mesh, mp_policy=policy, reshard_after_forward=options.zero3)
    # The stage's outputs stay in the compute dtype: the dtype the pipeline sends them in (and the last stage's
    # fp32 logits) is compiler/parallelize/message_dtype.py's.
    fully_shard(stage_module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=options.zero3)
    if options.zero3:
        _sync_every_microbatch(stage_module)
    return stage_module


def apply_moe_data_parallel(stage_module: nn.Module, meshes: MoeMeshes, *, policy: MixedPrecisionPolicy,
                            zero3: bool) -> None:
    """Each MoE layer's experts become an FSDP unit over ``meshes.experts`` and the rest of the layer (router,
    shared experts) one over ``meshes.tokens``: every rank in those meshes routes other tokens through the same
    weights, so their gradients are summed there. FSDP then divides by its mesh's size, not by the number of
    losses averaged (dp x cp; a sequence split over mp ranks under SP contributes parts of one loss, summed):
    ``moe_gradient_factors`` says by how much to correct (FSDP's own divide factor would need gloo's missing
    PREMUL_SUM). The router's selection bias is no gradient's: FSDP leaves it a plain tensor, the same on every
    rank (runtime/engine/experts.py updates it)."""
    for moe in moe_modules(stage_module):
        bias = getattr(moe.router, "expert_bias", None)
        ignored = {bias} if bias is not None else None
        for module, mesh in ((moe.experts, meshes.experts), (moe, meshes.tokens)):
            if mesh is not None:
                fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=zero3,
                            ignored_params=ignored if module is moe else None)


def moe_gradient_factors(stage_module: nn.Module, meshes: MoeMeshes) -> dict[int, float]:
    """id(parameter) -> the factor its reduced gradient takes: the gradient of the global batch's mean loss is
    the sum over the unit's mesh divided by dp x cp, and FSDP divided by the mesh's size (no FSDP: nothing
    divided). Only factors other than 1 are listed. Call after ``materialize`` (it gives parameters anew)."""
    factors = {}
    for moe in moe_modules(stage_module):
        experts = {id(p) for p in moe.experts.parameters()}
        for module, mesh in ((moe.experts, meshes.experts), (moe, meshes.tokens)):
            factor = (mesh.size() if mesh is not None else 1) / meshes.replicas
            if factor != 1:
                factors.update({id(p): factor for p in module.parameters()
                                if p.requires_grad and (module is moe.experts or id(p) not in experts)})
    return factors


def _sync_every_microbatch(fsdp_module: nn.Module) -> None:
    """Make the PipelineStage's per-micro-batch settings (no gradient sync, keep gathered parameters after
    backward) have no effect on this stage: it reduces and reshards after every backward, as ZeRO-3 does.
    The final REDUCE_GRAD then finds nothing left to reduce and only waits for the last reductions."""
    set_sync, set_reshard = fsdp_module.set_requires_gradient_sync, fsdp_module.set_reshard_after_backward
    fsdp_module.set_requires_gradient_sync = lambda _requires, *, recurse=True: set_sync(True, recurse=recurse)
    fsdp_module.set_reshard_after_backward = lambda _reshard, *, recurse=True: set_reshard(True, recurse=recurse)
