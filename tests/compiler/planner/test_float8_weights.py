"""The planner's memory under --fp8-all-gather (FSDP gathers the Float8 linears' weights as e4m3 bytes, one fp32 scale
each; everything else in the precision), checked against the engine's own model: its ``Float8Linear`` weights after
compiler/fp8's ``swap_linears``; and FP8 runs' context parallelism holding keys and values, never a latent
(compiler/context_gather.py's rule)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiler.context_gather import KV, LATENT, context_gather
from compiler.fp8 import RECIPES, Float8Linear, swap_linears
from compiler.parallel_plan import ParallelPlan
from compiler.planner.activations import Context, block_memory
from compiler.planner.cluster import resolve_cluster
from compiler.planner.float8_weights import largest_float8_weight
from compiler.planner.pricer import Pricer
from compiler.planner.shape import DENSE, DecoderShape
from models import build_model, named_config

H100 = resolve_cluster("h100-80gb")


def _float8_weights(cfg) -> tuple[int, int]:
    """(parameters, weight tensors) of the model's linears ``--fp8`` swaps for ``Float8Linear``s."""
    with torch.device("meta"):
        model = swap_linears(build_model(cfg, seed=0, device="meta"), RECIPES["tensorwise"])
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    return sum(w.numel() for w in weights), len(weights)


def _memory(shape: DecoderShape, plan: ParallelPlan, *, gather: bool) -> float:
    (memory,) = Pricer(shape, H100).memory(dataclasses.replace(plan, fp8_all_gather=gather))
    return memory


@pytest.mark.parametrize("name", ["small", "llama3-debug", "qwen3-moe-debug", "gpt-oss-debug", "deepseek-v3-debug"])
@pytest.mark.parametrize("precision, itemsize", [("bf16", 2), ("fp32", 4)])
def test_fsdp_gathers_the_float8_linears_weights_at_a_byte_each(name, precision, itemsize):
    """FSDP (one pp rank holding every layer, several micro-batches): the gathered weights are held for the step, so
    the plan with --fp8-all-gather holds (itemsize - 1) bytes less of each Float8 linear's parameter, plus its scale.
    GPT-2 (fused qkv, biases), Llama, Qwen3-MoE and gpt-oss (routed experts, routers), DeepSeek-V3 (latent attention,
    shared experts, dense first layers, an MTP depth)."""
    cfg = named_config(name)
    if name == "deepseek-v3-debug":
        cfg = dataclasses.replace(cfg, mtp_depth=1)
    params, weights = _float8_weights(cfg)
    shape = DecoderShape.from_config(cfg)
    plan = ParallelPlan(dp=2, schedule="1f1b", microbatches=2, micro_batch_size=1, precision=precision, fp8="tensorwise")
    saved = _memory(shape, plan, gather=False) - _memory(shape, plan, gather=True)
    assert saved == pytest.approx((itemsize - 1) * params - 4 * weights)


def test_zero3_holds_two_gathered_blocks_at_a_byte_a_float8_parameter():
    """ZeRO-3 holds the unit in use and the one prefetched: twice the largest unit's saving (a block here, the
    vocabulary small); its Float8 linears' weights counted from Llama's layout: q, k, v, o, gate, up, down."""
    d, kv, width = 256, 2 * 64, 1024
    shape = DecoderShape.from_flags(layers=2, d_model=d, heads=4, kv_heads=2, mlp_width=width, mlp="swiglu",
                                    seq_len=128, vocab_size=512)
    block = d * d + 2 * d * kv + d * d + 3 * d * width
    plan = ParallelPlan(dp=2, schedule="1f1b", microbatches=2, micro_batch_size=1, precision="bf16", fp8="tensorwise",
                        reshard_after_forward=True)
    saved = _memory(shape, plan, gather=False) - _memory(shape, plan, gather=True)
    assert saved == pytest.approx(2 * ((2 - 1) * block - 4 * 7))


def test_a_plan_that_does_not_shard_or_asks_nothing_keeps_the_precisions_gather():
    shape = DecoderShape.from_config(named_config("llama3-debug"))
    plan = ParallelPlan(dp=2, schedule="1f1b", microbatches=2, micro_batch_size=1, precision="bf16", fp8="tensorwise")
    replicated = dataclasses.replace(plan, dp_shard=1)
    assert _memory(shape, replicated, gather=True) == _memory(shape, replicated, gather=False)


def test_fp8_context_parallelism_holds_no_latent():
    """DeepSeek-V3 under CP: without FP8 each attention gathers and keeps its latent (r + rope values a token of the
    sequence) beside the keys and values kv_b expands; an FP8 run gathers the keys and values only."""
    shape = DecoderShape.from_config(named_config("deepseek-v3-debug"))
    latent = shape.latent
    assert context_gather(latent, kv_heads=shape.kv_heads, head_dim=shape.head_dim, mp=1).gathers == LATENT
    assert context_gather(latent, kv_heads=shape.kv_heads, head_dim=shape.head_dim, mp=1, fp8=True).gathers == KV
    plain = Context(micro_batch_size=2, precision="bf16", cp=2)
    fp8 = dataclasses.replace(plain, fp8=True)
    counted = (latent.kv_lora_rank + latent.rope_dim) * shape.seq_len * 2 * 2  # values x T x micro-batch x bf16 bytes
    with_latent, without = block_memory(shape, DENSE, plain), block_memory(shape, DENSE, fp8)
    assert with_latent.saved - without.saved == counted
    assert with_latent.transient - without.transient == counted
    gqa = DecoderShape.from_config(named_config("llama3-debug"))  # no latent: FP8 changes nothing
    assert block_memory(gqa, DENSE, plain) == block_memory(gqa, DENSE, fp8)


def test_the_pricer_prices_an_fp8_cp_run_without_the_latent():
    shape = DecoderShape.from_config(named_config("deepseek-v3-debug"))
    plan = ParallelPlan(cp=2, schedule="1f1b", microbatches=1, micro_batch_size=1, precision="bf16")
    pricer = Pricer(shape, H100)
    (plain,), (fp8,) = pricer.memory(plan), pricer.memory(dataclasses.replace(plan, fp8="tensorwise"))
    assert plain > fp8
    no_cp = dataclasses.replace(plan, cp=1)
    assert pricer.memory(no_cp) == pricer.memory(dataclasses.replace(no_cp, fp8="tensorwise"))


@pytest.mark.parametrize("name", ["small", "llama3-debug", "qwen3-moe-debug", "gpt-oss-debug", "deepseek-v3-debug"])
def test_the_largest_float8_weight_is_the_engine_s(name):
    """A CPU's FP8 backward holds fp32 copies of the block's largest Float8 weight (devices.py): the planner's
    largest is the largest ``Float8Linear`` weight of the engine's blocks."""
    cfg = named_config(name)
    with torch.device("meta"):
        model = swap_linears(build_model(cfg, seed=0, device="meta"), RECIPES["tensorwise"])
    engine = max(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    shape = DecoderShape.from_config(cfg)
    assert max(largest_float8_weight(shape, kind=kind) for kind in set(shape.kinds())) == engine


def test_a_cpu_prices_the_fp8_backward_s_copies_of_the_largest_weight():
    """On a CPU the FP8 plan's block backward holds 12 bytes of each element of its largest Float8 weight (13 where the
    backward quantizes the weight itself); a GPU's none. A single process: no FSDP, the backward is the peak."""
    shape = DecoderShape.from_flags(layers=2, d_model=256, heads=4, mlp_width=1024, seq_len=16, vocab_size=64)
    plan = ParallelPlan(schedule="1f1b", microbatches=1, micro_batch_size=1, precision="bf16", fp8="tensorwise")
    cpu = resolve_cluster("cpu-2core")
    (with_copies,) = Pricer(shape, cpu).memory(plan)
    no_copies = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, fp8_product_bytes_per_weight=0))
    (without,) = Pricer(shape, no_copies).memory(plan)
    assert with_copies - without == 13 * 256 * 1024
    assert Pricer(shape, H100).memory(plan) == Pricer(shape, H100).memory(dataclasses.replace(plan, fp8=None))
