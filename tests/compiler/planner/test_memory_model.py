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
    # shards of both (no sharded gradient in the backward), every parameter gathered, gradients of the trained ones
    assert weight_memory(100, 10, fsdp, frozen=60) == (40 * 12 + 60 * 4) / 4 + 100 * 2 + 40 * 4
    assert weight_memory(100, 10, fsdp) == 100 * 12 / 4 + 100 * 2 + 100 * 4  # no LoRA: as before


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


def test_gathering_every_unit_at_the_step_s_start_bounds_a_frozen_model_s_peak():
    """FSDP's all-gathers at the step's start hold every unit's input and output: shards + (1 + 1/S) x gathered +
    the largest unit (copied out). A LoRA run's steady phase is below it; full training's is above it."""
    from compiler.planner.memory_model import RankLoad, rank_memory, unshard_memory

    fsdp = DataParallelLayout(dp=2, shard=2, gather_bytes=4)
    assert unshard_memory(100, 10, fsdp, frozen=100) == 100 * 4 / 2 + 100 * 4 * 1.5 + 10 * 4
    load = RankLoad(dense_params=1000, expert_params=0, largest_unit=100, saved_bytes=0, recompute_bytes=0,
                    transient_bytes=0, weight_copy_bytes=0, blocks=1, frozen_dense=990)
    lora = rank_memory(load, schedule="1f1b", p=1, m=2, v=1, rank=0, dense=fsdp, experts=DataParallelLayout())
    assert lora.total == pytest.approx(unshard_memory(1000, 100, fsdp, frozen=990)) and lora.unshard_excess > 0
    full = rank_memory(RankLoad(1000, 0, 100, 0, 0, 0, 0, 1), schedule="1f1b", p=1, m=2, v=1, rank=0, dense=fsdp,
                       experts=DataParallelLayout())
    assert full.unshard_excess == 0 and full.total == weight_memory(1000, 100, fsdp)
    zero3 = DataParallelLayout(dp=2, shard=2, zero3=True, gather_bytes=4)  # gathers a unit at its use instead
    assert rank_memory(load, schedule="1f1b", p=1, m=2, v=1, rank=0, dense=zero3,
                       experts=DataParallelLayout()).unshard_excess == 0


def test_the_search_prices_a_lora_run_s_plans_so():
    """``--auto`` and the preflight's suggested plan search with the run's LoRA: every plan then needs less."""
    from compiler.planner.search import search

    shape, cluster = DecoderShape.from_config(named_config("llama3-debug")), load_cluster(LOCAL_PRESET)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v"))
    full, tuned = (search(shape, world=4, global_batch_size=8, cluster=cluster, precisions=("fp32",), collect=True,
                          lora=x).every for x in (None, lora))
    memory = {e.plan: e.memory_per_rank for e in full if e.memory_per_rank is not None}
    priced = [e for e in tuned if e.memory_per_rank is not None]
    assert len(priced) == len(memory) > 10
    assert all(e.memory_per_rank < memory[e.plan] for e in priced)


def test_fsdp_s_reduce_scatters_after_the_last_backward_are_a_phase_of_their_own():
    """After the last backward each unit's gradient is reduce-scattered in turn: at the first one that unit's gathered
    weights are freed, its sharded gradient is new and, on gloo, so is the clone of its flat gradient. Where
    activations are small this phase is the peak, and --fp8-all-gather saves less there than the gathered bytes'
    difference (the unit reduced has freed its gathered weights already)."""
    from compiler.planner.memory_model import Fp8Gathered, RankLoad, rank_memory, reduce_memory

    gloo = DataParallelLayout(dp=2, shard=2, gather_bytes=2, reduce_scatter_copies_input=True)
    nccl = DataParallelLayout(dp=2, shard=2, gather_bytes=2)
    assert reduce_memory(1000.0, 100, gloo) == 1000 - 100 * 2 + 100 * 4 * (1 / 2 + 1)
    assert reduce_memory(1000.0, 100, nccl) == 1000 - 100 * 2 + 100 * 4 / 2
    assert reduce_memory(1000.0, 100, gloo, fp8_unit=Fp8Gathered(80, 2)) == 1000 - (20 * 2 + 80 + 8) + 100 * 6

    params, unit = 1000, 100
    fp8, fp8_unit = Fp8Gathered(800, 8), Fp8Gathered(80, 2)  # of all parameters, and of the largest unit

    def peak(layout: DataParallelLayout, *, flag: bool, activations: float = 0.0):
        load = RankLoad(params, 0, unit, activations, 0, 0, 0, 4, fp8_gathered=fp8 if flag else Fp8Gathered(),
                        fp8_gathered_unit=fp8_unit if flag else Fp8Gathered())
        return rank_memory(load, schedule="1f1b", p=1, m=2, v=1, rank=0, dense=layout, experts=DataParallelLayout())

    small = peak(gloo, flag=True)
    assert small.reduce_excess > 0 and small.total == reduce_memory(weight_memory(params, unit, gloo, fp8=fp8), unit, gloo,
                                                                    fp8_unit=fp8_unit)
    gathered_difference = fp8.params * (2 - 1) - 4 * fp8.weights
    unit_difference = fp8_unit.params * (2 - 1) - 4 * fp8_unit.weights
    assert peak(gloo, flag=False).total - small.total == gathered_difference - unit_difference
    large = 10_000.0  # activations that dwarf the reduce-scatter's buffers: the backward is the peak, as before
    assert peak(gloo, flag=False, activations=large).total - peak(gloo, flag=True, activations=large).total == \
        gathered_difference
    assert peak(nccl, flag=False).reduce_excess == 0  # no copy: the unit's freed bf16 weights pay for its shard
    zero3 = DataParallelLayout(dp=2, shard=2, zero3=True, gather_bytes=2, reduce_scatter_copies_input=True)
    assert peak(zero3, flag=True).reduce_excess == 0  # ZeRO-3 reduces unit by unit in the backward
