"""Merging: W + (alpha / r) B A gives the adapted module's outputs from a plain one (peft's merge_and_unload)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compiler.lora import LoraExperts, LoraLinear, merged_weights
from models import GroupedExperts


def _random(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.3)
    return module


def test_a_merged_linear_computes_what_the_adapted_one_does():
    lora = _random(LoraLinear(nn.Linear(6, 5), rank=3, alpha=1.5))
    merged = merged_weights({f"q.{n}": p.detach() for n, p in lora.named_parameters()}, scale=0.5)
    assert set(merged) == {"q.weight", "q.bias"}
    x = torch.randn(4, 6)
    torch.testing.assert_close(x @ merged["q.weight"].T + merged["q.bias"], lora(x))


def test_merged_experts_compute_what_the_adapted_ones_do():
    lora = _random(LoraExperts(GroupedExperts(d_model=8, width=12, n_experts=3), rank=2, alpha=4.0))
    merged = merged_weights({n: p.detach() for n, p in lora.named_parameters()}, scale=2.0)
    plain = GroupedExperts(d_model=8, width=12, n_experts=3)
    plain.load_state_dict(merged)
    x, counts = torch.randn(5, 8), torch.tensor([2, 1, 2])
    torch.testing.assert_close(plain(x, counts), lora(x, counts))


def test_a_bf16_base_is_merged_in_float32_and_a_lone_adapter_refused():
    state = {"q.weight": torch.ones(2, 2, dtype=torch.bfloat16), "q.lora_A.weight": torch.ones(1, 2),
             "q.lora_B.weight": torch.full((2, 1), 1e-3)}
    merged = merged_weights(state, scale=1.0)["q.weight"]
    assert merged.dtype == torch.float32 and merged[0, 0].item() == pytest.approx(1.001)
    with pytest.raises(ValueError, match="no q.lora_B.weight"):
        merged_weights({"q.weight": torch.ones(2, 2), "q.lora_A.weight": torch.ones(1, 2)}, scale=1.0)
