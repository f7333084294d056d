"""LoRA's config and targets: what each family may adapt, by its own module names."""

from __future__ import annotations

import pytest

from compiler.lora import LoraConfig, default_targets, target_problem, valid_targets
from models import named_config


@pytest.mark.parametrize("model,targets", [
    ("llama3-debug", ("q", "k", "v", "o", "gate", "up", "down")),
    ("tiny", ("qkv", "o", "up", "down")),  # GPT-2: fused q/k/v
    ("qwen3-moe-debug", ("q", "k", "v", "o", "experts")),  # the router's gate is never a target
    ("deepseek-v3-debug", ("q_a", "q", "kv_a", "kv_b", "o", "gate", "up", "down", "experts")),
])
def test_each_family_offers_its_blocks_linear_layers_and_experts(model, targets):
    assert set(valid_targets(named_config(model))) == set(targets)
    assert "experts" not in default_targets(named_config(model))


def test_a_target_the_model_lacks_is_named_with_the_valid_ones():
    problem = target_problem(("q", "gate"), named_config("tiny"))
    assert problem.startswith("q, gate is not a module of gpt2's blocks") and "valid targets: qkv, o, up, down" in problem
    assert target_problem((), named_config("tiny")).startswith("no target given")
    assert target_problem(("qkv", "down"), named_config("tiny")) is None


def test_the_config_round_trips_through_a_recorded_run():
    lora = LoraConfig(rank=8, alpha=16.0, targets=("q", "v"), dropout=0.05, base_dtype="bf16", init_from="a")
    assert LoraConfig.from_dict(lora.to_dict()) == lora
    assert LoraConfig.from_dict({**lora.to_dict(), "targets": ["q", "v"]}) == lora  # JSON gives lists
    assert LoraConfig.from_dict(None) is None and lora.scale == 2.0
