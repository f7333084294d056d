"""Per-layer seconds (compiler/planner/layers.py, work.py, devices.py) against hand computations: a GEMM's three
products, TP / CP / EP collectives per block, and what each kind of activation checkpointing recomputes."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.planner.cluster import load_cluster
from compiler.planner.collectives import Link, all_gather_time, all_reduce_time, all_to_all_time, deduplicated_dispatch_time
from compiler.planner.devices import CpuDevice, Gemm
from compiler.planner.engines import THIS_ENGINE, TORCHTITAN
from compiler.planner.layers import Setup, layer_table
from compiler.planner.shape import DENSE, MOE, DecoderShape, tensor_parallel_modules
from compiler.planner.work import block_work, moe_mlp_work
from models import named_config
from models.spec import Experts

H100 = load_cluster("h100-80gb")
SHAPE = DecoderShape.from_flags(layers=4, d_model=4096, heads=32, kv_heads=8, mlp="swiglu", mlp_width=14336,
                                seq_len=8192, vocab_size=128256)
MOE_SHAPE = dataclasses.replace(SHAPE, experts=Experts(64, 8, 2048))


def test_a_gemm_runs_three_products_each_at_the_efficiency_of_its_reduction():
    g, e, peak = Gemm(8192, 6144, 4096), H100.device.gemm.efficiency, 989e12
    forward, backward = H100.device._products(g, peak, False, itemsize=2)
    flops = 2 * 8192 * 6144 * 4096
    assert forward == pytest.approx(flops / (peak * e(4096)))
    assert backward == pytest.approx(flops / (peak * e(6144)) + flops / (peak * e(8192)))
    # A grouped product with few rows per expert also reaches only rows / (rows + k_half) of it.
    few = Gemm(64, 2048, 4096, groups=8)
    f_grouped, _ = H100.device._products(few, peak, True, itemsize=2)
    assert f_grouped == pytest.approx(few.flops / (peak * e(4096) * 64 / (64 + 128)))


@pytest.mark.parametrize(("n", "itemsize", "aligned"), [
    (50304, 2, True), (50264, 2, True), (50257, 2, False), (50260, 2, False), (50260, 4, True), (50258, 4, False)])
def test_a_product_whose_rows_are_off_16_bytes_runs_all_three_products_on_the_unaligned_kernels(n, itemsize, aligned):
    """GPT-2's head, [8192, 768] x [768, 50,257]: the logits' rows are 50,257 values long, in bf16 not a multiple of
    16 bytes, and the forward, the input gradient and the weight gradient all read or write them."""
    g, e, peak = Gemm(8192, n, 768), H100.device.gemm.efficiency, 989e12
    slow = 1.0 if aligned else H100.device.unaligned_slowdown
    forward, backward = H100.device._products(g, peak, False, itemsize=itemsize)
    assert forward == pytest.approx(g.flops * slow / (peak * e(768)))
    assert backward == pytest.approx(g.flops * slow / (peak * e(n)) + g.flops * slow / (peak * e(8192)))
    # a reduction off 16 bytes (k: the rows of x and of the weight) as well
    assert H100.device._products(Gemm(8192, 768, n), peak, False, itemsize=itemsize)[0] == pytest.approx(
        g.flops * slow / (peak * e(n)))


def _one(shape, kind, **setup):
    return layer_table(shape, H100, THIS_ENGINE, Setup(precision="bf16", **setup)).layers[kind]


def test_tensor_parallel_collectives_per_block():
    s = dict(micro_batch_size=1, mp=8, dp=1, pp=1)
    link = H100.topology.group_link(8, 1)
    one = all_reduce_time(8192 * 4096 * 2, 8, link)  # [b, T, d] in bf16
    assert _one(SHAPE, DENSE, **s).tp == pytest.approx(4 * one)
    assert _one(SHAPE, DENSE, sequence_parallel=True, **s).tp == pytest.approx(4 * one)  # AG + RS: the same volume
    assert _one(SHAPE, DENSE, ac="full", **s).tp == pytest.approx(6 * one)  # the recomputed forward's two
    assert _one(MOE_SHAPE, MOE, **s).tp == pytest.approx(2 * one)  # attention's only: experts run on shards


def test_context_parallel_gathers_k_and_v_and_scatters_their_gradients():
    link = H100.topology.group_link(4, 2)  # cp ranks sit inside the TP group's stride
    kv = 2 * 8192 * 2 * 1024 / 2 * 2  # b T (k and v) kv_width / mp, bf16
    assert _one(SHAPE, DENSE, micro_batch_size=2, mp=2, cp=4).cp == pytest.approx(2 * all_gather_time(kv, 4, link))
    assert _one(SHAPE, DENSE, micro_batch_size=2, mp=2, cp=1).cp == 0


def test_context_parallel_sliding_layers_exchange_halos_where_the_window_fits_a_chunk():
    """gpt-oss-20b (window 128, 8 K/V heads of 64) at T 32,768 over cp 4: a sliding block receives the 127 keys and
    values before each of its chunks from both neighbours (one message each, at once), a full block all-gathers;
    engines without halos, and a window longer than a chunk (T 512: chunks of 64), gather on both."""
    shape = dataclasses.replace(DecoderShape.from_config(named_config("gpt-oss-20b")), seq_len=32768)
    link = H100.topology.group_link(4, THIS_ENGINE.strides({"cp": 4})["cp"])
    halo = link.transfer(2 * 127 * 8 * (64 + 64) * 2)  # both neighbours' W - 1 keys and values, bf16
    gather = all_gather_time(32768 * 2 * 8 * 64 * 2, 4, link)
    table = layer_table(shape, H100, THIS_ENGINE, Setup(precision="bf16", micro_batch_size=1, cp=4)).layers
    assert table["moe@128"].cp == pytest.approx(2 * halo) and table["moe"].cp == pytest.approx(2 * gather)
    assert halo < gather / 10
    full_ac = layer_table(shape, H100, THIS_ENGINE, Setup(precision="bf16", micro_batch_size=1, cp=4, ac="full"))
    assert full_ac.layers["moe@128"].cp == pytest.approx(3 * halo)  # the recomputed forward's exchange too
    titan = layer_table(shape, H100, TORCHTITAN, Setup(precision="bf16", micro_batch_size=1, cp=4)).layers
    assert titan["moe@128"].cp == pytest.approx(titan["moe"].cp)
    short = dataclasses.replace(shape, seq_len=512)
    table = layer_table(short, H100, THIS_ENGINE, Setup(precision="bf16", micro_batch_size=1, cp=4)).layers
    assert table["moe@128"].cp == pytest.approx(table["moe"].cp)


def test_expert_parallel_all_to_alls_per_moe_block():
    ep_link = H100.topology.all_to_all_link(8, 1)
    copies = 8192 * 8 * 4096 * 2  # the rank's tokens x top_k x d, bf16
    assert _one(MOE_SHAPE, MOE, micro_batch_size=1, ep=8, dp=8).ep == pytest.approx(4 * all_to_all_time(copies, 8, ep_link))
    assert _one(MOE_SHAPE, MOE, micro_batch_size=1, ep=8, dp=8, ac="full").ep == pytest.approx(
        6 * all_to_all_time(copies, 8, ep_link))


def test_deepep_dispatch_is_priced_where_the_engine_uses_it():
    """The EP group of 32 ranks (mp 2 x dp 16, ETP 1) spans 4 nodes of 8: DeepEP's node-deduplicated dispatch."""
    t = H100.topology
    deepep = dataclasses.replace(THIS_ENGINE, ep_dispatch="deepep")
    setup = Setup(1, "bf16", mp=2, ep=32, dp=16, sequence_parallel=True)
    tokens = 8192 / 2 * 4096 * 2  # the rank's sequence shard x d, bf16
    expected = deduplicated_dispatch_time(tokens, experts=64, top_k=8, ranks=32, ranks_per_node=8,
                                          intra=Link(t.intra.bandwidth * t.efficiency, t.intra.latency),
                                          inter=Link(t.inter.bandwidth * t.efficiency, t.inter.latency))
    priced = layer_table(MOE_SHAPE, H100, deepep, setup).layers[MOE].ep
    assert priced == pytest.approx(4 * expected)
    assert priced < 0.6 * layer_table(MOE_SHAPE, H100, THIS_ENGINE, setup).layers[MOE].ep


def test_what_checkpointing_recomputes():
    none = _one(SHAPE, DENSE, micro_batch_size=1).compute
    full = _one(SHAPE, DENSE, micro_batch_size=1, ac="full").compute
    selective = _one(SHAPE, DENSE, micro_batch_size=1, ac="selective").compute
    assert full.backward == pytest.approx(none.backward + none.forward)  # the whole forward again
    assert selective.backward == pytest.approx(none.backward + none.memory_bound_forward)  # norms, activations
    # torchtitan's op-level policy recomputes every other matrix product as well.
    titan = layer_table(SHAPE, H100, TORCHTITAN, Setup(1, "bf16", ac="selective")).layers[DENSE].compute
    matmuls = none.forward - none.memory_bound_forward
    assert titan.backward == pytest.approx(none.backward + none.memory_bound_forward + 0.5 * matmuls)


def test_megatrons_moe_recompute_runs_the_moe_mlp_and_its_all_to_alls_again():
    """--recompute-modules moe: beyond selective recompute's memory-bound forward, the MoE MLP's products (router,
    grouped experts) and its forward dispatch and combine run again in the backward; attention's do not."""
    setup = Setup(1, "bf16", mp=2, ep=8, dp=4, sequence_parallel=True, ac="selective")
    products = layer_table(MOE_SHAPE, H100, THIS_ENGINE, setup).layers[MOE]
    moe_engine = dataclasses.replace(THIS_ENGINE, selective_policy="products+moe")
    again = layer_table(MOE_SHAPE, H100, moe_engine, setup).layers[MOE]
    mlp = H100.device.compute(moe_mlp_work(MOE_SHAPE, micro_batch_size=1, mp=2, cp=1, ep=8, precision="bf16"), "bf16")
    assert mlp.forward - mlp.memory_bound_forward > 0.3 * (products.compute.forward - products.compute.memory_bound_forward)
    assert again.compute.backward == pytest.approx(products.compute.backward + mlp.forward - mlp.memory_bound_forward)
    assert again.compute.forward == products.compute.forward
    assert again.ep == pytest.approx(products.ep * 6 / 4)
    dense = layer_table(SHAPE, H100, moe_engine, setup).layers[DENSE]  # a dense block: as under "products"
    assert dense == layer_table(SHAPE, H100, THIS_ENGINE, setup).layers[DENSE]


def test_transformer_engines_attention_runs_at_cudnns_speed_where_the_device_states_it():
    """Megatron-Core's attention (TE: cuDNN's fused kernel on Hopper) at the H100's measured speed-up over
    FlashAttention-2, forward and backward; the rest of the block, and devices without a speed-up, unchanged."""
    fused, flash = (block_work(SHAPE, DENSE, micro_batch_size=1, mp=1, cp=1, ep=1, precision="bf16",
                               sequence_parallel=False, traits=dataclasses.replace(THIS_ENGINE, attention=kind))
                    for kind in ("fused", "flash"))
    assert fused.attention_kernel == "fused" and flash.attention_kernel == "flash"
    h100 = H100.device
    up_f, up_b = h100.fused_attention_speedup
    assert up_f > 1.5 and up_b > 1.5  # 539 / 335 and 516 / 322 TFLOP/s (FlashAttention-3 paper, sec. 4.1)
    e = h100.gemm.efficiency(128) * h100.peak("bf16")
    attention = fused.attention_flops
    a, b = h100.compute(flash, "bf16"), h100.compute(fused, "bf16")
    assert a.forward - b.forward == pytest.approx(attention / e * (1 - 1 / up_f))
    assert a.backward - b.backward == pytest.approx(2.5 * attention / e * (1 - 1 / up_b))
    a100 = load_cluster("a100-80gb").device
    assert a100.fused_attention_speedup is None and a100.compute(fused, "bf16") == a100.compute(flash, "bf16")


def test_context_parallel_splits_the_causal_attention_work_evenly():
    """Load-balanced (2 cp chunks, head-tail): every rank runs 1/cp of the causal attention FLOPs."""
    whole = block_work(SHAPE, DENSE, micro_batch_size=1, mp=1, cp=1, ep=1, precision="bf16", sequence_parallel=False,
                       traits=THIS_ENGINE)
    split = block_work(SHAPE, DENSE, micro_batch_size=1, mp=1, cp=4, ep=1, precision="bf16", sequence_parallel=False,
                       traits=THIS_ENGINE)
    assert whole.attention_flops == pytest.approx(4 * 8192 * 8192 * 4096 / 2)  # causal half of 4 T^2 (H hd)
    assert split.attention_flops == pytest.approx(whole.attention_flops / 4)
    assert sum(g.flops for g in split.gemms) == pytest.approx(sum(g.flops for g in whole.gemms) / 4)


def test_the_cpu_prices_attention_at_the_causal_half_its_flash_kernel_runs():
    """FlopCounterMode counts attention's whole T x T; the CPU's flash kernel runs the causal half (forward, and
    2.5x that backward): the CPU device times the FLOPs run, the block's matrix products at the block rate and
    attention at its calibrated attention rate for the sequence and head dim."""
    cpu = load_cluster("cpu-2core").device
    work = block_work(SHAPE, DENSE, micro_batch_size=1, mp=1, cp=1, ep=1, precision="fp32", sequence_parallel=False,
                      traits=THIS_ENGINE)
    assert work.attention_keys == SHAPE.seq_len
    rate = cpu.rate("fp32", ranks_on_node=1)
    attention = cpu.attention_rate("fp32", keys=SHAPE.seq_len, head_dim=SHAPE.head_dim, ranks_on_node=1)
    assert attention != rate  # its own calibrated rate (74.6 GFLOP/s per core at T 8192, hd 128, fp32)
    matmuls = sum(g.flops for g in work.gemms)
    seconds = cpu.compute(work, "fp32")
    assert seconds.forward == pytest.approx(matmuls / rate + work.attention_flops / attention)
    assert seconds.backward == pytest.approx(2 * matmuls / rate + 2.5 * work.attention_flops / attention
                                             + cpu.layer_overhead)


def test_the_cpu_attention_rate_is_interpolated_in_log_sequence_and_log_head_dim():
    points = {"bf16": ((512, 32, 10.0), (2048, 32, 30.0), (512, 128, 20.0), (2048, 128, 60.0))}
    cpu = CpuDevice(flops={"bf16": 100.0, "fp32": 50.0}, peak_flops={}, units_per_node=2, memory_per_node=1.0,
                    attention_points=points)

    def rate(t, hd, ranks=2):
        return cpu.attention_rate("bf16", keys=t, head_dim=hd, ranks_on_node=ranks)
    assert rate(1024, 32) == pytest.approx(20.0)  # halfway in log T between 10 and 30
    assert rate(1024, 64) == pytest.approx(30.0)  # then halfway in log hd between 20 (hd 32) and 40 (hd 128)
    assert rate(100, 32) == pytest.approx(10.0) and rate(10**5, 128) == pytest.approx(60.0)  # clamped
    assert rate(2048, 128, ranks=1) == pytest.approx(120.0)  # one rank on two cores: two threads
    assert cpu.attention_rate("fp32", keys=2048, head_dim=64, ranks_on_node=2) == 50.0  # no points: block rate


def test_the_cpu_prices_a_mixture_of_experts_layer_at_its_own_calibrated_rate_and_fixed_cost():
    """An MoE layer's router, top-k, token sort and per-expert products run below the dense block rate with a
    larger fixed cost (calibrate fits both on Mixtral blocks); dense layers keep the dense figures."""
    cpu = dataclasses.replace(load_cluster("cpu-2core").device, attention_points=None,
                              moe_flops={"bf16": 40e9}, moe_layer_overhead={"bf16": 0.008})
    setup = dict(micro_batch_size=4, mp=1, cp=1, ep=1, precision="bf16", sequence_parallel=False, traits=THIS_ENGINE)
    moe, dense = block_work(MOE_SHAPE, MOE, **setup), block_work(SHAPE, DENSE, **setup)
    threads = cpu.units_per_node  # one rank on the node: every core
    seconds = cpu.compute(moe, "bf16")
    a, rate = moe.attention_flops, cpu.rate("bf16", ranks_on_node=1)  # attention: its own rate (here the block's)
    assert seconds.forward == pytest.approx((moe.counted_forward_flops - 2 * a) / (threads * 40e9) + a / rate)
    assert seconds.backward == pytest.approx((moe.counted_flops - moe.counted_forward_flops - 5 * a) / (threads * 40e9)
                                             + 2.5 * a / rate + 0.008)
    assert cpu.compute(dense, "bf16").backward == pytest.approx(
        (dense.counted_flops - dense.counted_forward_flops - 2.5 * dense.attention_flops) / rate + cpu.layer_overhead)


def test_each_tensor_parallel_module_of_a_block_costs_the_cpu_its_dtensor_dispatch():
    """mp > 1 on CPU: DTensor's Python dispatch at each TP module's boundaries costs ~1 ms per micro-batch here
    (calibrate's tp_module_overhead), more than the whole plain block's fixed cost; mp 1 pays nothing."""
    cpu = dataclasses.replace(load_cluster("cpu-2core").device, attention_points=None,
                              tp_module_overhead={"bf16": 0.001})
    without = dataclasses.replace(cpu, tp_module_overhead=None)
    setup = dict(micro_batch_size=4, cp=1, ep=1, precision="bf16", traits=THIS_ENGINE)
    alone = block_work(SHAPE, DENSE, mp=1, sequence_parallel=False, **setup)
    assert alone.tensor_parallel_modules == 0 and cpu.compute(alone, "bf16") == without.compute(alone, "bf16")
    for sp in (False, True):
        sharded = block_work(SHAPE, DENSE, mp=2, sequence_parallel=sp, **setup)
        assert sharded.tensor_parallel_modules == tensor_parallel_modules(SHAPE, DENSE, sequence_parallel=sp)
        extra = cpu.compute(sharded, "bf16").backward - without.compute(sharded, "bf16").backward
        assert extra == pytest.approx(0.001 * sharded.tensor_parallel_modules)
    cluster = load_cluster("cpu-2core")
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, tp_module_overhead={"bf16": 0.001}))
    assert cluster.rescaled(2.0, "slower").device.tp_module_overhead == {"bf16": pytest.approx(0.002)}


@pytest.mark.parametrize("name", ["tiny", "llama3-debug", "qwen3-debug", "qwen3-moe-debug", "mixtral-debug",
                                  "deepseek-v3-debug"])
def test_a_blocks_tensor_parallel_modules_are_those_the_engines_plan_shards(name):
    from models import named_config, spec_of

    cfg = named_config(name)
    spec, shape = spec_of(cfg), DecoderShape.from_config(cfg)
    model = spec.build(cfg)
    for sp in (False, True):
        plan = spec.block_plan(sequence_parallel=sp)
        for i, kind in enumerate(shape.kinds()):
            held = dict(model.layers[str(i)].named_modules())
            assert tensor_parallel_modules(shape, kind, sequence_parallel=sp) == sum(key in held for key in plan), (i, sp)
