"""LoRA applied to a stage (or a whole model): the targeted modules wrapped, the base frozen, and the adapters
sharded with their base under tensor parallelism.

``apply_lora`` runs on the meta device right after the traced stage's real ``nn.Linear``s are put back and before
tensor parallelism (compiler/parallelize/stages.py): every targeted module (compiler/lora/config.py) becomes its
adapted version holding the same Parameters (compiler/lora/modules.py), every other parameter stops requiring
gradients (no gradient, no AdamW state: runtime/engine/build.py gives the optimizer the trained ones only), and with
``base_dtype`` bf16 the frozen matrices are stored in bf16.

Tensor parallelism (``with_adapters``): the base linear keeps the style its family's plan gives it, and its adapters
are sharded by the rule that keeps every product local (Megatron-LM's layout applied to B A; the same split as
Megatron-Core's and NeMo's LoRA adapters):
- column-parallel base (W Shard(0), output features split): A whole (Replicate), B by its output rows (Shard(0)):
  y_r = W_r x + s B_r (A x); in backward A's gradient is a sum over the ranks' B_r, left ``Partial`` by DTensor and
  summed with the other partial gradients (FSDP's reduction, or runtime/engine/partial_grads.py);
- row-parallel base (W Shard(1), input features split): A by its input columns (Shard(1)), B whole: the rank's
  partial W_r x_r + s B (A_r x_r) is one partial sum, reduced by the base's own all-reduce (or reduce-scatter under
  sequence parallelism); B's gradient is a sum over the ranks' A_r x_r, left ``Partial`` likewise;
- a replicated base (latent attention's down projections under SP): A and B replicated.
The adapters' matrices are DTensors on the mp mesh: checkpoints, exports and the gradient norm read them as every
other TP parameter. FSDP then shards them like any parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from compiler.lora.config import EXPERTS, LoraConfig, target_kind
from compiler.lora.modules import LoraExperts, LoraLinear, is_adapter
from models import spec_of

_BF16_BASE = {"fp32": None, "bf16": torch.bfloat16}


def apply_lora(module: nn.Module, lora: LoraConfig) -> list[str]:
    """Adapt ``module``'s targeted modules, freeze the rest, store the frozen matrices in ``lora.base_dtype``;
    returns the adapted modules' names. ``module`` keeps the model's names (a stage, or the whole model)."""
    adapted = []
    for name, child in list(module.named_modules()):
        kind = target_kind(name, child)
        if kind is None or kind not in lora.targets:
            continue
        wrapper = LoraExperts if kind == EXPERTS else LoraLinear
        module.set_submodule(name, wrapper(child, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout))
        adapted.append(name)
    freeze_base(module)
    base_dtype = _BF16_BASE[lora.base_dtype]
    stored: dict[int, nn.Parameter] = {}  # a weight two modules share (a tied head) stays one Parameter
    for owner_name, owner in module.named_modules():
        for attr, param in list(owner.named_parameters(recurse=False)):
            if base_dtype is not None and not param.requires_grad and param.is_floating_point() and param.ndim >= 2:
                if id(param) not in stored:
                    stored[id(param)] = nn.Parameter(param.detach().to(base_dtype), requires_grad=False)
                setattr(owner, attr, stored[id(param)])
    return adapted


def freeze_base(module: nn.Module) -> None:
    """Every parameter but the adapters stops requiring gradients. Called again after tensor parallelism: torch's
    styles (``SequenceParallel``'s norms) register the parameters they distribute as requiring gradients."""
    for name, param in module.named_parameters():
        if not is_adapter(name):
            param.requires_grad_(False)


def lora_parameter_shapes(model_cfg: Any, lora: LoraConfig | None) -> dict[str, tuple[int, ...]]:
    """Every parameter a run of ``model_cfg`` with ``lora`` keeps (a tied head's copy, the adapters) and its shape."""
    with torch.device("meta"):
        model = spec_of(model_cfg).build(model_cfg, share_tied_weights=False)
        if lora is not None:
            apply_lora(model, lora)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}


def adapter_placements(placement: Placement) -> tuple[list[Placement], list[Placement]]:
    """(A's, B's) placements on the mp mesh for a base weight of ``placement`` there (module docstring)."""
    if placement == Shard(0):
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


class LoraTensorParallel(ParallelStyle):
    """``base_style`` (the family plan's style of the linear) on the base weight, the adapters by the rule above."""

    def __init__(self, base_style: ParallelStyle):
        super().__init__()
        self.base_style = base_style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        adapters = {name: getattr(module, name) for name in ("lora_A", "lora_B")}
        for name in adapters:  # the base style shards every parameter it finds: hide the adapters from it
            delattr(module, name)
        parallelize_module(module, device_mesh, self.base_style)
        weight = module.weight
        placement = weight.placements[0] if isinstance(weight, DTensor) else Replicate()
        for (name, adapter), placements in zip(adapters.items(), adapter_placements(placement)):
            # src_data_rank=None: nothing is sent; each rank materialises (or loads) its own shard
            sharded = distribute_tensor(adapter.weight.detach(), device_mesh, placements, src_data_rank=None)
            adapter.weight = nn.Parameter(sharded, requires_grad=adapter.weight.requires_grad)
            setattr(module, name, adapter)
        return module


def with_adapters(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """The style to apply to ``module``: ``style`` itself, or for an adapted linear the same with its adapters."""
    return LoraTensorParallel(style) if isinstance(module, LoraLinear) else style
