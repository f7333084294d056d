"""``Float8Linear`` and ``swap_linears``: a model's ``nn.Linear``s computed by ``fp8_linear``, parameters unchanged.

A ``Float8Linear`` is an ``nn.Linear`` holding the very ``weight`` and ``bias`` Parameters of the module it
replaces, so state dicts, tensor-parallel plans (keyed by module name, applied to ``nn.Linear``s) and optimizer
state see the same names, shapes and tensors. Swap before tensor parallelism and FSDP, as torchtitan converts to
float8 first: a new module does not carry the old one's hooks. Tensor parallelism then makes its parameters
DTensors, which ``forward`` computes on as tensor_parallel.py says; ``shards`` holds what the placements cannot
say (token shards).

What stays in high precision (``keep_high_precision``, by the naming contract of models/spec.py): the LM head
(``head``; its logits feed the loss directly), the token embedding (``tok_emb``, not a product), and every
router (``router``: the MoE block's router and its ``gate``, models/common/moe.py and router.py; routing runs
in fp32 on purpose). Norms are not ``nn.Linear``s. The experts' stacked weights are not ``nn.Linear``s either:
grouped.py swaps their product.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compiler.fp8.guard import AmaxGuard
from compiler.fp8.linear import LinearShards, fp8_linear
from compiler.fp8.recipe import Recipe
from compiler.fp8.tensor_parallel import fp8_linear_dtensor
from models.spec import LM_HEAD, TOKEN_EMBEDDING

ROUTER = "router"  # models/common/moe.py: ``MoE.router``, whose ``gate`` is an nn.Linear read by the router in fp32


def keep_high_precision(name: str, module: nn.Module) -> bool:
    """The default filter: True for the head, the embedding and anything inside a router."""
    parts = name.split(".")
    return parts[-1] in (LM_HEAD, TOKEN_EMBEDDING) or ROUTER in parts


class Float8Linear(nn.Linear):
    recipe: Recipe
    shards: LinearShards
    guard: AmaxGuard | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, shards: LinearShards = LinearShards(),
                    guard: AmaxGuard | None = None) -> Float8Linear:
        with torch.device("meta"):  # no allocation: the Parameters are the old module's
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe, new.shards, new.guard = recipe, shards, guard
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):  # tensor-parallel: scales over the whole tensor (tensor_parallel.py)
            return fp8_linear_dtensor(x, self.weight, self.bias, self.recipe, shards=self.shards, guard=self.guard)
        return fp8_linear(x, self.weight, self.bias, self.recipe, shards=self.shards, guard=self.guard)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.name}"


def swap_linears(module: nn.Module, recipe: Recipe, *, skip: Callable[[str, nn.Module], bool] = keep_high_precision,
                 guard: AmaxGuard | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``module`` (by qualified name) that ``skip`` does not keep with a
    ``Float8Linear`` of ``recipe``; returns ``module`` (or the replacement, when it is itself a Linear)."""
    if type(module) is nn.Linear:
        return module if skip("", module) else Float8Linear.from_linear(module, recipe, guard=guard)
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and not skip(name, child):
                setattr(parent, child_name, Float8Linear.from_linear(child, recipe, guard=guard))
    return module
