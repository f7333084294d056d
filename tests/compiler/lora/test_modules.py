"""The adapted modules compute peft's LoRA: base(x) + (alpha / r) B A dropout(x), per expert for the experts, keeping
the base's Parameters and names; the adapters start as peft's (B zero, A kaiming-uniform), seeded by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiler.lora import LoraExperts, LoraLinear, adapter_initial_value, base_of, is_adapter
from models import GroupedExperts


def _randomised(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def test_a_linear_keeps_its_parameters_and_adds_the_scaled_low_rank_update():
    base = nn.Linear(6, 5)
    lora = _randomised(LoraLinear(base, rank=3, alpha=6.0))
    assert lora.weight is base.weight and lora.bias is base.bias
    assert [n for n, _ in lora.named_parameters()] == ["weight", "bias", "lora_A.weight", "lora_B.weight"]
    x = torch.randn(2, 4, 6)
    a, b = lora.lora_A.weight, lora.lora_B.weight
    want = x @ base.weight.T + base.bias + 2.0 * (x @ a.T @ b.T)
    torch.testing.assert_close(lora(x), want)


def test_dropout_applies_in_training_passes_only():
    lora = _randomised(LoraLinear(nn.Linear(64, 64, bias=False), rank=4, alpha=4.0, dropout=0.5))
    x = torch.randn(8, 64)
    plain = x @ lora.weight.T + x @ lora.lora_A.weight.T @ lora.lora_B.weight.T
    with torch.no_grad():  # validation: the engine does not switch its stages to eval mode
        torch.testing.assert_close(lora(x), plain)
    assert not torch.allclose(lora(x), plain)
    lora.eval()
    torch.testing.assert_close(lora(x), plain)


def test_initial_values_are_peft_s_and_depend_on_the_name_alone():
    b = adapter_initial_value("layers.0.attn.q.lora_B.weight", (48, 4), seed=1)
    assert b.shape == (48, 4) and not b.any()
    a = adapter_initial_value("layers.0.attn.q.lora_A.weight", (4, 400), seed=1)
    bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=sqrt(5)): sqrt(3) sqrt(2 / 6) / sqrt(fan_in)
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    torch.testing.assert_close(a, adapter_initial_value("layers.0.attn.q.lora_A.weight", (4, 400), seed=1), rtol=0, atol=0)
    assert not torch.equal(a, adapter_initial_value("layers.1.attn.q.lora_A.weight", (4, 400), seed=1))
    experts = adapter_initial_value("layers.1.moe.experts.w2_lora_A", (3, 4, 10), seed=1)
    assert experts.abs().max() <= 1 / math.sqrt(10)
    assert not adapter_initial_value("layers.1.moe.experts.w2_lora_B", (3, 10, 4), seed=1).any()


def test_adapter_names_and_their_base_weights():
    assert is_adapter("layers.0.attn.q.lora_A.weight") and is_adapter("layers.2.moe.experts.w3_lora_B")
    assert not is_adapter("layers.0.attn.q.weight") and not is_adapter("layers.0.attn.lora.weight")
    assert base_of("layers.0.attn.q.lora_B.weight") == "layers.0.attn.q.weight"
    assert base_of("layers.2.moe.experts.w3_lora_A") == "layers.2.moe.experts.w3"


def test_experts_compute_each_expert_s_adapted_swiglu_on_its_rows():
    base = GroupedExperts(d_model=8, width=12, n_experts=3)
    lora = _randomised(LoraExperts(base, rank=2, alpha=4.0))
    assert lora.w1 is base.w1 and lora.w2 is base.w2
    assert [n for n, _ in lora.named_parameters()][3:] == ["w1_lora_A", "w1_lora_B", "w3_lora_A", "w3_lora_B",
                                                           "w2_lora_A", "w2_lora_B"]
    assert lora.w2_lora_A.shape == (3, 2, 12) and lora.w2_lora_B.shape == (3, 8, 2)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(6, 8)  # the last row is padding past the counts: zeros

    def adapted(rows, e, name):
        w, a, b = (getattr(lora, n)[e] for n in (name, f"{name}_lora_A", f"{name}_lora_B"))
        return rows @ w.T + 2.0 * rows @ a.T @ b.T

    want, start = torch.zeros(6, 8), 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        want[start:start + n] = adapted(F.silu(adapted(rows, e, "w1")) * adapted(rows, e, "w3"), e, "w2")
        start += n
    torch.testing.assert_close(lora(x, counts), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_experts_compute_in_the_autocast_dtype(dtype):
    lora = _randomised(LoraExperts(GroupedExperts(d_model=8, width=12, n_experts=2), rank=2, alpha=2.0))
    with torch.autocast("cpu", dtype=dtype):
        assert lora(torch.randn(4, 8), torch.tensor([1, 3])).dtype == dtype
