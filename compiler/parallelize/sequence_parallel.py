"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2.2) on top of Megatron's tensor parallelism.

Between the tensor-parallel regions (attention, MLP) a block's activations are the same on every mp rank:
the norms and the residual stream compute and store B x T x D values mp times over. Sequence parallelism
splits them along the sequence instead: each mp rank keeps T/mp positions of the residual stream and runs
the norms on them; attention and the MLP all-gather the sequence before their column-parallel matrices
("g") and their row-parallel matrices reduce-scatter over the sequence instead of all-reducing ("g-bar").
An all-reduce is a reduce-scatter plus an all-gather, so the communicated bytes are the same while the
norms' and residual's activations shrink mp-fold.

Here a family's plan names the pieces (models/spec.py): ``SEQUENCE_NORM`` (DTensor's ``SequenceParallel``:
the norm's input is a Shard(1) DTensor, its weight Replicate), ``GATHER_SEQUENCE`` (``GatherSequence``
below, on the attention and MLP modules), ``ROWWISE_SCATTER`` (``RowwiseParallel(output_layouts=Shard(1))``).

Pipeline stages still exchange whole (B, T, D) activations (the traced receive buffers have that shape),
so a stage's run of blocks starts by keeping its own sequence shard (a local slice: no communication
forward, an all-gather of the gradient backward) and ends by all-gathering the sequence (backward: the
gradient's local slice). The embedding and the final norm + head run on whole sequences as without SP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


def _sequence_shards(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """(B, T/mp, D) local shard, or a DTensor of any placement -> a Shard(1) DTensor."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _on_hidden_states(args: tuple, fn) -> tuple:
    """``fn`` applied to the hidden states among a module's inputs, the other inputs (integer positions of
    packed documents) as they are. Traced modules do not keep the Python argument order (a block may take
    (positions, x)), so the hidden states are told by their floating-point dtype, not their place."""
    return tuple(fn(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


class GatherSequence(ParallelStyle):
    """The module's hidden states arrive as sequence shards (B, T/mp, D) and are all-gathered to a Replicate
    DTensor (B, T, D) that its column-parallel linears consume directly: in backward their partial input
    gradients are summed as DTensors and reduce-scattered once, here. Other inputs (positions) pass as they are.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple):
            return _on_hidden_states(
                args, lambda x: _sequence_shards(x, device_mesh).redistribute(device_mesh, [Replicate()]))

        module.register_forward_pre_hook(gather)
        return module


def scatter_sequence_at_stage_ends(stage_module: nn.Module, blocks: list[str], mesh: DeviceMesh) -> None:
    """The first of the stage's blocks takes its whole (B, T, D) input as this rank's sequence shard, the
    last gives back the whole sequence: the stage's interface stays that of the traced graph."""
    if not blocks:
        return

    def keep_own_shard(_module: nn.Module, args: tuple):
        return _on_hidden_states(args, lambda x: DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                 .redistribute(mesh, [Shard(1)]).to_local())  # (B, T/mp, D)

    def gather_whole(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _sequence_shards(out, mesh).redistribute(mesh, [Replicate()]).to_local()  # (B, T, D)

    stage_module.get_submodule(blocks[0]).register_forward_pre_hook(keep_own_shard)
    stage_module.get_submodule(blocks[-1]).register_forward_hook(gather_whole)
