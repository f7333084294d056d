"""Expert parallelism (Lepikhin et al. 2021, GShard; DeepSeek-V3 sec. 3.2): each of the ``ep`` ranks of an
expert-parallel group holds E/ep of a mixture-of-experts layer's experts, and tokens travel to the rank
holding their expert and back with two all-to-alls (dispatch and combine; their backward passes are two
more).

The model's MoE layer (models/common/moe.py) routes its tokens, sorts the N·k (token, expert) assignments
by expert and calls its ``experts`` module with ``(x_sorted (M, D), counts (E,))``: rows of expert 0 first,
then expert 1, and so on. ``ExpertParallel`` wraps that call; the experts' weights become DTensors sharded
on their expert dimension over the group (rank r holds experts [r·L, (r+1)·L), L = E/ep), and:

1. the counts are exchanged (all-to-all of E integers), so each rank knows how many rows every peer sends
   each of its local experts: ``recv_counts`` (ep, L), source-major;
2. rows are dispatched (uneven all-to-all: rank r's block for peer s is the rows of s's experts, already
   contiguous since rows are sorted by expert); what arrives is source-major, expert-minor;
3. rows are regrouped expert-major (a permutation), the local experts compute, the rows go back to
   source-major (the inverse permutation) and are combined (the reverse all-to-all).

Dropless: every assignment is computed; the row counts are uneven and data-dependent, hence the host copy
of the splits (as torchtitan's dispatcher does). Autograd runs through the functional all-to-all (its
backward is the reverse all-to-all). Every rank of the group must call the layer the same number of times
in the same order: all ranks of an ep group run the same stage with the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from compiler.torch_compat import all_to_all_single_autograd
from models import BalanceLoss, MoE

ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows (R, D), counts (L,)) -> (R, D)


def dispatch_to_experts(x_sorted: torch.Tensor, counts: torch.Tensor, *, group: dist.ProcessGroup,
                        compute: ExpertCompute, by_source: bool = False) -> torch.Tensor:
    """The MoE layer's expert outputs for ``x_sorted`` (M, D) (rows sorted by global expert, ``counts`` (E,)
    rows per expert), computed by the ranks of ``group`` that hold each expert: ``compute`` is this rank's
    local experts on rows sorted by local expert, given their counts (L,), or with ``by_source`` (L, ep): each
    local expert's rows from each peer (FP8 quantizes each peer's micro-batch apart, compiler/fp8/grouped.py).
    Returns (M, D) in ``x_sorted``'s order."""
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    send_counts = counts.reshape(ep, local_experts)  # rows for peer s's local expert l
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts.view(-1), send_counts.contiguous().view(-1), group=group)  # (ep, L)
    in_splits = send_counts.sum(1).tolist()
    out_splits = recv_counts.sum(1).tolist()
    received = all_to_all_single_autograd(x_sorted, out_splits, in_splits, group)  # (R, D) source-major
    order = expert_major_order(recv_counts)
    y = compute(received[order], recv_counts.t() if by_source else recv_counts.sum(0))  # (R, D), expert-major
    y = y[torch.argsort(order)]  # back to source-major
    return all_to_all_single_autograd(y, in_splits, out_splits, group)  # (M, D)


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """The permutation that takes rows laid out source-major, expert-minor (blocks of ``counts[s, l]`` rows for
    s = 0.., l = 0..) to expert-major, source-minor order: ``rows[order]`` is grouped by expert."""
    sizes = counts.flatten()  # block sizes, source-major
    starts = torch.cumsum(sizes, 0) - sizes  # each block's first row, source-major
    sizes_by_expert = counts.t().flatten()
    starts_by_expert = starts.view(counts.shape).t().flatten()
    total = int(sizes.sum())
    # Row i of the expert-major layout: its block's first row plus its offset within the block.
    block_offsets = torch.cumsum(sizes_by_expert, 0) - sizes_by_expert
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(block_offsets, sizes_by_expert,
                                                                                 output_size=total)
    return torch.repeat_interleave(starts_by_expert, sizes_by_expert, output_size=total) + within


def apply_expert_parallel(experts: nn.Module, ep_mesh: DeviceMesh, *, local_compute: Callable[..., torch.Tensor],
                          by_source: bool = False) -> nn.Module:
    """Shard ``experts``' parameters (each [E, ...]) on their expert dimension over ``ep_mesh`` and route its
    calls through ``dispatch_to_experts``. ``local_compute(x, counts, *local_weights)`` computes with the local
    experts' parameters in the module's registration order (the experts' ``compute``: the model's grouped product,
    biases included, each rank's rows of every parameter being its own experts').; ``by_source``: counts (L, ep)."""
    names = [name for name, _ in experts.named_parameters(recurse=False)]
    for name in names:
        param = getattr(experts, name)
        # src_data_rank=None: no broadcast; each rank materialises (or loads) just its experts.
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    group = ep_mesh.get_group()

    def forward(x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [_local(getattr(experts, name)) for name in names]
        return dispatch_to_experts(x_sorted, counts, group=group, by_source=by_source,
                                   compute=lambda rows, local_counts: local_compute(rows, local_counts, *weights))

    experts.forward = forward
    return experts


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


@dataclass(frozen=True)
class MoeMeshes:
    """Where a mixture-of-experts layer's pieces live (runtime/distributed/mesh.py ``moe_meshes``)."""

    ep: DeviceMesh | None  # the expert-parallel group: each rank holds E/ep experts (None: ep = 1)
    experts: DeviceMesh | None  # the other ranks that route tokens through the same experts: FSDP over them
    tokens: DeviceMesh | None  # every rank that routes other tokens through the router and shared experts
    sequence: DeviceMesh | None  # ranks holding parts of the same sequences (cp, and mp under SP)
    replicas: int  # the losses averaged into a gradient (dp x cp): FSDP divides the summed gradients by it


def moe_modules(stage_module: nn.Module) -> list[MoE]:
    return [m for m in stage_module.modules() if isinstance(m, MoE)]


class StepBalanceLoss(nn.Module):
    """The engine's wrapper of a MoE layer's auxiliary loss (``MoE.balance``, models/common/load_balance.py): it
    calls the model's ``BalanceLoss`` (its child ``loss``) with what only the engine knows. A sequence's tokens
    may be spread over the ranks of ``sequence`` (SP, CP): f's counts are summed there and this rank's share of L
    is taken. ``grad_scale``, the gradient's scale for the step (S / m x cp), is this module's own: the step sets
    it before each step (runtime/engine/experts.py), and the model never sees it but as an argument."""

    def __init__(self, loss: BalanceLoss, *, sequence: DeviceMesh | None):
        super().__init__()
        self.loss = loss
        self.grad_scale = 1.0
        self.shards = sequence.size() if sequence is not None else 1
        self.sequence_group = sequence.get_group() if sequence is not None else None

    def forward(self, out: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, *,
                batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.sequence_group
        return self.loss(out, scores, experts, batch=batch, shards=self.shards, grad_scale=self.grad_scale,
                         sum_over_shards=(lambda t: _summed(t, group)) if group is not None else None)


def apply_moe_parallelism(stage_module: nn.Module, meshes: MoeMeshes, *, sequence_parallel: bool,
                          local_compute: Callable[..., torch.Tensor] | None = None,
                          by_source: bool = False) -> list[MoE]:
    """Expert parallelism over ``meshes.ep`` for every MoE layer of the stage (its experts computed by
    ``local_compute``, ``apply_expert_parallel``'s; default: the experts module's own ``compute``), and its auxiliary loss wrapped
    (``StepBalanceLoss``) to see the sequence splits, a sequence's tokens spread over ``meshes.sequence``, and
    the step's gradient scale. Under sequence parallelism the layer takes its input (the sequence-parallel
    norm's Shard(1) DTensor) as this rank's own (B, T/mp, D) tokens and routes them, returning a local shard."""
    layers = moe_modules(stage_module)
    for moe in layers:
        if meshes.ep is not None:
            # LoRA's experts (compiler/lora/modules.py) compute their adapters with the local experts' too; FP8's
            # (compiler/parallelize/float8.py) quantize each source rank's rows apart
            compute = local_compute or getattr(moe.experts, "local_compute", moe.experts.compute)
            apply_expert_parallel(moe.experts, meshes.ep, local_compute=compute, by_source=by_source)
        if moe.balance is not None:
            moe.balance = StepBalanceLoss(moe.balance, sequence=meshes.sequence)
        if sequence_parallel:
            moe.register_forward_pre_hook(lambda _m, args: tuple(_local(a) for a in args))
    return layers


def _summed(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t
