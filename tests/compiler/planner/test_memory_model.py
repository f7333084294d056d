"""The memory model under LoRA: the frozen base is weights alone (4 bytes, or 2 stored in bf16), the adapters
weights, gradients and AdamW state (16 bytes), counted as the engine builds them."""

from __future__ import annotations

import math

import pytest

from compiler.lora import LoraConfig, is_adapter
from compiler.parallel_plan import ParallelPlan
from compiler.parallelize.lora import lora_parameter_shapes
from compiler.planner.cluster import LOCAL_PRESET, load_cluster
from compiler.planner.memory_model import DataParallelLayout, weight_memory
from compiler.planner.pricer import Pricer
from compiler.planner.shape import DecoderShape, parameter_count
from models import named_config


def test_frozen_parameters_cost_their_weights_alone():
    assert weight_memory(100, 10, DataParallelLayout(), frozen=60) == 40 * 16 + 60 * 4
    assert weight_memory(100, 10, DataParallelLayout(), frozen=60, frozen_bytes=2) == 40 * 16 + 60 * 2
    fsdp = DataParallelLayout(dp=4, shard=4, gather_bytes=2)
    # shards of both, every parameter gathered, gradients of the trained ones only
    assert weight_memory(100, 10, fsdp, frozen=60) == (40 * 16 + 60 * 4) / 4 + 100 * 2 + 40 * 4
    assert weight_memory(100, 10, fsdp) == 100 * 16 / 4 + 100 * 2 + 100 * 4  # no LoRA: as before


def _adapters(cfg, lora: LoraConfig) -> int:
    """The adapters the engine builds (compiler/parallelize/lora.py)."""
    return sum(math.prod(s) for n, s in lora_parameter_shapes(cfg, lora).items() if is_adapter(n))


@pytest.mark.parametrize("model,targets", [("llama3-debug", ("q", "k", "v", "o", "gate", "up", "down")),
                                           ("tiny", ("qkv", "down")),
                                           ("qwen3-moe-debug", ("q", "o", "experts"))])
def test_lora_prices_the_base_frozen_and_the_adapters_the_engine_builds(model, targets):
    cfg = named_config(model, n_layers=2)
    shape, cluster = DecoderShape.from_config(cfg), load_cluster(LOCAL_PRESET)
    plan = ParallelPlan(precision="fp32", microbatches=2, micro_batch_size=2)  # one process: no FSDP, no casts
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    (full,) = Pricer(shape, cluster).memory(plan)
    (tuned,) = Pricer(shape, cluster, lora=lora).memory(plan)
    params, adapters = parameter_count(shape), _adapters(cfg, lora)
    assert full - tuned == pytest.approx(16 * params - (4 * params + 16 * adapters))
    (bf16_base,) = Pricer(shape, cluster, lora=LoraConfig(rank=4, alpha=8.0, targets=targets, base_dtype="bf16")).memory(
        plan)
    assert tuned - bf16_base == pytest.approx(2 * params)
