"""The adapted modules: a linear layer and a mixture's routed experts with LoRA adapters beside their weights.

Each is the module it replaces, holding the very same Parameters under the same names (``LoraLinear`` is an
``nn.Linear``, ``LoraExperts`` a ``GroupedExperts``), so checkpoints of the base, Hugging Face reading and
tensor-parallel plans (keyed by module name, applied to ``nn.Linear``s) see what they saw; the adapters are new
names beside them:

- ``<linear>.lora_A.weight`` [r, in] and ``<linear>.lora_B.weight`` [out, r], peft's names without its adapter
  name (what peft saves: ``base_model.model.<module>.lora_A.weight``);
- ``<experts>.w1_lora_A`` [E, r, D], ``w1_lora_B`` [E, F, r] and likewise for ``w3`` (up) and ``w2`` (down,
  A [E, r, F], B [E, D, r]): one adapter per expert, stacked on dim 0 as the experts' own matrices are, so expert
  parallelism and FSDP shard them with their expert and no adapter is shared between experts' ranks.

Initial values (peft's default, ``init_lora_weights=True``): B zero, so training starts from the base model, and A
``kaiming_uniform_(a=sqrt(5))``, i.e. uniform in +-1/sqrt(in) (gain sqrt(2 / (1 + 5)), bound sqrt(3) gain /
sqrt(fan_in)); drawn from a generator seeded by the parameter's name, so every mesh initialises them alike.

Dropout (``dropout`` > 0) draws from each rank's torch generator, in training passes only. Under tensor parallelism
DTensor's RNG tracker keeps a replicated input's mask alike on the mp ranks on CUDA meshes; on CPU meshes each rank
draws its own (DTensor warns), so its mp ranks may drop different features of one input (the gradients are those of
what was computed either way). Every rank is seeded alike (``--seed``), so data-parallel replicas draw alike too.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from models import GroupedExperts, grouped_mm
from models.spec import name_seed

_ADAPTER = re.compile(r"(\.lora_[AB]\.weight|_lora_[AB])$")
EXPERT_MATRICES = ("w1", "w3", "w2")  # GroupedExperts' gate, up and down, in its parameter order


def is_adapter(name: str) -> bool:
    return _ADAPTER.search(name) is not None


def base_of(name: str) -> str:
    """The base weight an adapter belongs to: ``x.q.lora_A.weight`` -> ``x.q.weight``, ``x.w1_lora_B`` -> ``x.w1``."""
    return _ADAPTER.sub(lambda m: ".weight" if m.group(1).startswith(".") else "", name)


def adapter_initial_value(name: str, shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """An adapter's initial value (module docstring): zeros for B, uniform in +-1/sqrt(in) for A [..., r, in]."""
    if name.endswith(("lora_B.weight", "_lora_B")):
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[-1])
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # Training passes only: the engine validates under no_grad without switching its stages to eval mode.
    return F.dropout(x, p, training=training and torch.is_grad_enabled()) if p else x


class LoraLinear(nn.Linear):
    """``base(x) + scale * lora_B(lora_A(dropout(x)))``, peft's ``Linear`` forward; ``base``'s Parameters kept."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0):
        with torch.device("meta"):  # no allocation: the weight and bias are the base's
            super().__init__(base.in_features, base.out_features, bias=False)
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device)
        self.scale = alpha / rank
        self.dropout = dropout
        self.train(base.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under tensor parallelism x and every weight are DTensors (compiler/parallelize/lora.py): the adapters'
        # products run sharded like the base's, and a row-parallel base's partial sums and the adapter's share one
        # reduction.
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(_dropout(x, self.dropout, self.training))) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scale={self.scale:g}"


class LoraExperts(GroupedExperts):
    """A mixture's routed experts with one adapter per expert on each of its matrices (module docstring)."""

    def __init__(self, base: GroupedExperts, *, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # GroupedExperts' own __init__ would allocate its matrices
        self.n_experts = base.n_experts
        self.w1, self.w3, self.w2 = base.w1, base.w3, base.w2
        for name in EXPERT_MATRICES:
            experts, out_features, in_features = getattr(base, name).shape
            device = getattr(base, name).device
            self.register_parameter(f"{name}_lora_A", nn.Parameter(torch.empty(experts, rank, in_features, device=device)))
            self.register_parameter(f"{name}_lora_B", nn.Parameter(torch.empty(experts, out_features, rank, device=device)))
        self.scale = alpha / rank
        self.dropout = dropout
        self.train(base.training)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.local_compute(x, counts, *(p for _, p in self.named_parameters(recurse=False)))

    def local_compute(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor, *adapters: torch.Tensor) -> torch.Tensor:
        """``experts_swiglu`` (models/common/moe.py) with each product adapted: x (M, D) rows sorted by expert,
        counts (E,), the weights in parameter order (expert parallelism passes a rank's local experts') -> (M, D)."""
        offsets = counts.cumsum(0, dtype=torch.int32)  # (E,) where each expert's rows end
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:  # the grouped product is not on autocast's lists: cast as autocast would
            x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
            adapters = tuple(t.to(dtype) for t in adapters)
        a1, b1, a3, b3, a2, b2 = adapters

        def adapted(rows: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            update = grouped_mm(grouped_mm(_dropout(rows, self.dropout, self.training), a, offsets), b, offsets)
            return grouped_mm(rows, w, offsets) + update * self.scale  # (M, out): (M, r) in between

        h = F.silu(adapted(x, w1, a1, b1)) * adapted(x, w3, a3, b3)  # (M, F)
        return adapted(h, w2, a2, b2)  # (M, D)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
