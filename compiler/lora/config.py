"""What LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") trains: one frozen dataclass,
and which of a model's modules it may adapt.

A LoRA run freezes every parameter of the model (its "base") and adds to each targeted linear layer y = W x (+ b)
a low-rank update: y = W x (+ b) + (alpha / r) B A dropout(x), A [r, in], B [out, r] (Hu et al. sec. 4.1; peft's
``LoraLayer``: scaling = lora_alpha / r). Only A and B are trained.

Why not a field of ``ParallelPlan`` (compiler/parallel_plan.py): the plan is how a run is laid out on its ranks,
and every plan of a run trains the same function; LoRA changes which function is trained and what is saved (a
model and training choice, like the model's shape), so it is a config of its own that the engine, the planner's
memory model and the exports read beside the plan (runtime/config.py ``TrainConfig.lora``).

Targets are named by the module's own name in a block, its last component, per family: ``q``, ``k``, ``v``, ``o``
(GPT-2: ``qkv``, ``o``; latent attention: ``q_a``, ``q``, ``kv_a``, ``kv_b``, ``o``), ``gate``, ``up``, ``down``
(a dense MLP's and a mixture's shared experts'), and ``experts``: a mixture's routed experts, each with adapters of
its own on its gate, up and down matrices (stacked [E, ...] as the experts are, so expert parallelism shards them
with their expert). A router is never a target (routing stays in fp32 and unchanged).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from models import GroupedExperts, spec_of

EXPERTS = "experts"  # the routed experts' stacked matrices
ROUTER = "router"  # models/common/moe.py: ``MoE.router``, never adapted
BASE_DTYPES = ("fp32", "bf16")  # the frozen base's storage: the training dtype (fp32), or bf16


@dataclass(frozen=True)
class LoraConfig:
    rank: int  # r
    alpha: float  # the update is scaled by alpha / r
    targets: tuple[str, ...]  # module names within a block (see the module docstring), EXPERTS for routed experts
    dropout: float = 0.0  # on each adapter's input, in training passes only
    base_dtype: str = "fp32"  # storage of the frozen matrices: "fp32" or "bf16" (needs bf16 compute)
    init_from: str | None = None  # a peft adapter folder the adapters start from (else A kaiming-uniform, B zero)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any] | None) -> "LoraConfig | None":
        """A recorded run's LoRA (``TrainConfig.to_dict()["lora"]``); None for a run without."""
        if not d:
            return None
        known = {f.name for f in dataclasses.fields(LoraConfig)}
        fields = {k: v for k, v in d.items() if k in known}
        return LoraConfig(**{**fields, "targets": tuple(fields["targets"])})


def target_kind(name: str, module: nn.Module) -> str | None:
    """The target ``module`` (named ``name`` in the model) is, or None: a linear layer inside a block, by its last
    name component, or a block's routed experts; nothing outside the blocks (embedding, head) or in a router."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or ROUTER in parts:
        return None
    if type(module) is nn.Linear:
        return parts[-1]
    if isinstance(module, GroupedExperts):
        return EXPERTS
    return None


def model_targets(model: nn.Module) -> dict[str, list[str]]:
    """Each target of ``model`` -> the names of the modules it adapts, in model order."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        kind = target_kind(name, module)
        if kind is not None:
            found.setdefault(kind, []).append(name)
    return found


@functools.lru_cache(maxsize=16)
def valid_targets(model_cfg: Any) -> tuple[str, ...]:
    """The targets a model of ``model_cfg`` has, in block order (built on the meta device: no memory)."""
    with torch.device("meta"):
        return tuple(model_targets(spec_of(model_cfg).build(model_cfg)))


def default_targets(model_cfg: Any) -> tuple[str, ...]:
    """Every linear layer of the blocks (QLoRA's choice, Dettmers et al. 2023 sec. 4), not the routed experts."""
    return tuple(t for t in valid_targets(model_cfg) if t != EXPERTS)


def target_problem(targets: tuple[str, ...], model_cfg: Any) -> str | None:
    """Why ``targets`` cannot adapt a model of ``model_cfg`` (a name it does not have, none given), or None."""
    valid = valid_targets(model_cfg)
    unknown = [t for t in targets if t not in valid]
    if not targets or unknown:
        what = f"{', '.join(unknown)} is not a module of {model_cfg.family}'s blocks" if unknown else "no target given"
        return f"{what}; valid targets: {', '.join(valid)}"
    return None
