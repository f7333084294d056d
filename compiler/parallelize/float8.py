"""``--fp8``: a stage's matrix products in FP8 (compiler/fp8/), with every scale over the whole logical tensor.

Applied to each traced stage once its ``nn.Linear``s are real again and before tensor parallelism (a new module
does not carry the old one's hooks; torchtitan converts to float8 first too):

1. every ``nn.Linear`` but the LM head, the token embedding and the routers becomes a ``Float8Linear`` holding
   the same Parameters (compiler/fp8/modules.py); under tensor parallelism its forward reads the DTensor
   placements and reduces the amaxes of W, x and dy over mp where they are shards (compiler/fp8/tensor_parallel.py);
2. what the placements cannot say is set here: the token shards. Under context parallelism each rank holds T/cp
   tokens of every sequence, so x and dy are token shards of the micro-batch's tensors: their scales that span
   tokens take the MAX over cp. Inside a mixture-of-experts layer the tokens are the layer's own, split over the
   ``sequence`` ranks (cp, and mp under sequence parallelism, where each mp rank routes its own T/mp tokens): the
   shared experts' linears and the routed experts reduce over those;
3. the routed experts compute in FP8 (compiler/fp8/grouped.py); under expert parallelism
   ``expert_parallel_compute`` is the local compute, given each local expert's rows per source rank so that each
   source's micro-batch is quantized apart, as one process quantizes each micro-batch.

Data parallelism needs nothing: FSDP gathers whole weights (in the precision) before the products, and a
one-process run quantizes each micro-batch apart too. With ``--fp8-all-gather`` (tensorwise) FSDP gathers them in
FP8 instead (compiler/fp8/fsdp_all_gather.py): after TP and before FSDP each ``Float8Linear``'s weight (its local
TP shard) becomes an ``Fp8AllGatherWeight``, quantized before the gather with the whole weight's scale, and the
step calls ``precompute_fp8_all_gather_amaxes`` first (one all-reduce per group for every weight's amax).
Every rank's amax guard (``AmaxGuard``) joins the step's world-wide vote (runtime/engine/step.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from compiler.fp8 import AmaxGuard, Float8Linear, LinearShards, Recipe, Shards, fp8_experts_compute, swap_linears
from compiler.fp8.fsdp_all_gather import Fp8AllGatherWeight, precompute_whole_amaxes
from compiler.fp8.grouped import swap_grouped_experts
from compiler.fp8.recipe import FULL
from compiler.fp8.tensor import GRAD_DGRAD, GRAD_WGRAD, INPUT_FORWARD, INPUT_WGRAD, WEIGHT_DGRAD, WEIGHT_FORWARD, Role
from compiler.fp8.tensor_parallel import max_over
from compiler.torch_compat import dtensor_local
from models import MoE, spec_of
from models.spec import COLWISE, MOE, ROWWISE, ROWWISE_SCATTER


@dataclass(frozen=True)
class Fp8Options:
    recipe: Recipe
    all_gather: bool = False  # FSDP gathers the Float8Linears' weights in FP8 (tensorwise; runtime/config.py checks)
    guard: AmaxGuard = field(default_factory=AmaxGuard)  # this rank's non-finite-amax flag, read by the step


def maybe_apply_fp8(stage_module: nn.Module, options: Fp8Options | None, *, context_parallel: DeviceMesh | None,
                    sequence: DeviceMesh | None) -> nn.Module:
    """Steps 1-3 of the module docstring on a stage (nothing when ``options`` is None). ``context_parallel``: the
    cp mesh; ``sequence``: the ranks holding parts of a mixture layer's tokens (MoeMeshes.sequence)."""
    if options is None:
        return stage_module
    swap_linears(stage_module, options.recipe, guard=options.guard)
    in_moe = {id(m) for moe in stage_module.modules() if isinstance(moe, MoE) for m in moe.modules()}
    dense_tokens, moe_tokens = _token_shards(context_parallel), _token_shards(sequence)
    for module in stage_module.modules():
        if isinstance(module, Float8Linear):
            module.shards = moe_tokens if id(module) in in_moe else dense_tokens
    swap_grouped_experts(stage_module, options.recipe, guard=options.guard, token_reduce=_token_reduce(sequence))
    return stage_module


def maybe_apply_fp8_all_gather(stage_module: nn.Module, options: Fp8Options | None) -> nn.Module:
    """After tensor parallelism, before FSDP: every ``Float8Linear`` weight (a DTensor's local shard under TP)
    becomes an ``Fp8AllGatherWeight`` in a new Parameter (nothing when ``options`` does not ask for it)."""
    if options is None or not options.all_gather:
        return stage_module
    for module in stage_module.modules():
        if isinstance(module, Float8Linear):
            weight = module.weight
            module.weight = nn.Parameter(_fp8_all_gather_weight(weight.detach(), options), requires_grad=weight.requires_grad)
    return stage_module


def _fp8_all_gather_weight(weight: torch.Tensor, options: Fp8Options) -> torch.Tensor:
    if not isinstance(weight, DTensor):
        return Fp8AllGatherWeight(weight, options.recipe, guard=options.guard)
    (placement,) = weight.placements  # tensor parallelism's 1-D mp mesh
    tp_group = weight.device_mesh.get_group() if isinstance(placement, Shard) and weight.device_mesh.size() > 1 else None
    local = Fp8AllGatherWeight(weight.to_local(), options.recipe, guard=options.guard, tp_group=tp_group)
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


class Fp8AllGatherAmaxes:
    """The step's whole-weight amaxes of the weights FSDP gathers in FP8 (compiler/fp8/fsdp_all_gather.py) on
    ``stage_modules`` (FSDP-sharded): ``before_step`` reduces them over the mesh dimensions that shard each weight
    (FSDP's, and mp's for a TP-sharded one) in one all-reduce per group; ``after_step`` (once the optimizer has
    changed the weights) forgets them."""

    def __init__(self, stage_modules: list[nn.Module]):
        self.stage_modules = stage_modules

    def _shards(self) -> list[tuple[Fp8AllGatherWeight, tuple]]:
        shards = []
        for stage_module in self.stage_modules:
            for module in stage_module.modules():
                weight = module.weight if isinstance(module, Float8Linear) else None
                local = dtensor_local(weight) if isinstance(weight, DTensor) else None
                # sharded now (a weight FSDP holds gathered keeps the scale it was gathered with)
                if isinstance(local, Fp8AllGatherWeight):
                    mesh = weight.device_mesh
                    groups = tuple(mesh.get_group(d) for d, p in enumerate(weight.placements)
                                   if not p.is_replicate() and mesh.size(d) > 1)
                    shards.append((local, groups))
        return shards

    def before_step(self) -> None:
        precompute_whole_amaxes(self._shards())

    def after_step(self) -> None:
        for shard, _ in self._shards():
            shard.forget_whole_amax()


def master_weight(t: torch.Tensor) -> torch.Tensor:
    """A parameter as checkpoints hold it: an ``Fp8AllGatherWeight`` (or a DTensor of one) unwrapped to the
    high-precision tensor it wraps (the same storage), anything else as it is."""
    local = dtensor_local(t) if isinstance(t, DTensor) else t
    if not isinstance(local, Fp8AllGatherWeight):
        return t
    if not isinstance(t, DTensor):
        return local.master
    return DTensor.from_local(local.master, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def expert_parallel_compute(options: Fp8Options, *, sequence: DeviceMesh | None) -> Callable[..., torch.Tensor]:
    """The experts' local compute under expert parallelism, to be called with (L, ep) counts by source."""
    return fp8_experts_compute(options.recipe, guard=options.guard, token_reduce=_token_reduce(sequence))


def _token_reduce(mesh: DeviceMesh | None):
    return max_over(mesh.get_group()) if mesh is not None and mesh.size() > 1 else None


def _token_shards(mesh: DeviceMesh | None) -> LinearShards:
    reduce = _token_reduce(mesh)
    if reduce is None:
        return LinearShards()
    return LinearShards(input=(Shards(0, reduce),), grad_output=(Shards(0, reduce),))


# What tensor parallelism shards of each kind of linear: (role, dimension of its own layout, local size).
_COLUMN_SHARDS = ((WEIGHT_FORWARD, 0), (WEIGHT_DGRAD, 0), (GRAD_DGRAD, 1), (GRAD_WGRAD, 1))  # W rows, dy features: N
_ROW_SHARDS = ((INPUT_FORWARD, 1), (INPUT_WGRAD, 1), (WEIGHT_FORWARD, 1), (WEIGHT_DGRAD, 1))  # x features, W columns: K
_TOKEN_ROLES = (INPUT_FORWARD, INPUT_WGRAD, GRAD_DGRAD, GRAD_WGRAD)


def fp8_shard_problem(model: Any, recipe: Recipe, *, mp: int, cp: int, sequence_parallel: bool) -> str | None:
    """Why this mesh would cut a fixed-size scaling block of ``recipe`` (blockwise's 128-wide tiles and blocks)
    across ranks, so that no rank could scale it as the whole tensor is scaled; None when every shard holds whole
    blocks (scales spanning a shard are reduced instead, which any shape allows)."""
    if cp > 1:
        chunk = model.seq_len // (2 * cp)  # context parallelism's load-balanced chunks of each sequence
        for role in _TOKEN_ROLES:
            size = _fixed(recipe, role, 0)
            if size and chunk % size:
                return (f"context parallelism's chunks of {chunk} tokens (--seq-len / 2 --cp) split its {size}-token "
                        f"scaling tiles; --seq-len must be a multiple of {2 * cp * size}")
        split_tokens = True
    else:
        split_tokens = sequence_parallel and mp > 1
    if split_tokens and MOE in spec_of(model).block_kinds(model) and any(_fixed(recipe, r, 0) for r in _TOKEN_ROLES):
        return ("a mixture's experts would see parts of a micro-batch's tokens on several ranks (context parallelism, "
                "or sequence parallelism's own tokens per mp rank), splitting their token tiles")
    if mp > 1:
        for name, style, out_features, in_features in _tensor_parallel_linears(model, sequence_parallel):
            shards = _COLUMN_SHARDS if style == COLWISE else _ROW_SHARDS
            local = out_features // mp if style == COLWISE else in_features // mp
            for role, dim in shards:
                size = _fixed(recipe, role, dim)
                if size and local % size:
                    return (f"{name} ({out_features} x {in_features}) on --mp {mp} holds {local} "
                            f"{'rows' if style == COLWISE else 'columns'} per rank, which splits its {size}-wide "
                            f"scaling blocks")
    return None


def _fixed(recipe: Recipe, role: Role, dim: int) -> int | None:
    size = recipe.blocks[role][dim]
    return size if size is not FULL and size > 1 else None


@functools.lru_cache(maxsize=16)
def _tensor_parallel_linears(model: Any, sequence_parallel: bool) -> tuple[tuple[str, str, int, int], ...]:
    """(name, COLWISE or ROWWISE, out, in) of every linear the family's TP plan shards (one meta build)."""
    spec = spec_of(model)
    styles = {k: COLWISE if v == COLWISE else ROWWISE for k, v in spec.block_plan(sequence_parallel=sequence_parallel).items()
              if v in (COLWISE, ROWWISE, ROWWISE_SCATTER)}
    with torch.device("meta"):
        built = spec.build(model)
    out = []
    for name, module in built.named_modules():
        parts = name.split(".")
        key = ".".join(parts[2:])
        if parts[0] == "layers" and key in styles and isinstance(module, nn.Linear):
            out.append((name, styles[key], module.out_features, module.in_features))
    return tuple(out)
