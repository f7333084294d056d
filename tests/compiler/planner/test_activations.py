"""Saved activations (compiler/planner/activations.py) against hand computations: Korthikanti et al.'s
layout, sequence and context parallelism, selective and full checkpointing, MoE blocks, the chunked loss, the
gradients a block's backward holds and the phase of the peak."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.parallelize.cross_entropy import SAVED_BYTES_PER_TOKEN, chunk_rows
from compiler.planner.activations import Context, block_memory, head_memory, mlp_backward_bytes
from compiler.planner.attention_memory import banded_scores_bytes, engine_attention
from compiler.planner.shape import DENSE, MOE, DecoderShape
from models import named_config
from models.spec import Experts

LLAMA = DecoderShape.from_flags(layers=2, d_model=4096, heads=32, kv_heads=8, mlp="swiglu", mlp_width=14336,
                                seq_len=8192, vocab_size=128256)
T, D, F, Q, KV = 8192, 4096, 14336, 4096, 1024


def test_megatron_layout_by_hand_with_and_without_sequence_parallelism():
    c = Context(micro_batch_size=1, precision="bf16", mp=8, layout="megatron")
    per_token = 4 * D * 2 + (Q + 2 * KV + Q) / 8 * 2 + 32 / 8 * 4 + 3 * F / 8 * 2  # norms, attention, SwiGLU
    assert block_memory(LLAMA, DENSE, c).saved == pytest.approx(T * per_token)
    sp = block_memory(LLAMA, DENSE, dataclasses.replace(c, sequence_parallel=True)).saved
    assert sp == pytest.approx(T * (per_token - 4 * D * 2 * (1 - 1 / 8)))  # the norm and linear inputs: 1/mp


def test_full_checkpointing_keeps_the_block_input_and_recomputes_one_block_at_a_time():
    c = Context(micro_batch_size=2, precision="bf16", mp=8, sequence_parallel=True, ac="full", layout="megatron")
    m = block_memory(LLAMA, DENSE, c)
    assert m.saved == pytest.approx(2 * T * D * 2 / 8)
    assert m.recompute == block_memory(LLAMA, DENSE, dataclasses.replace(c, ac="none")).saved


def test_selective_checkpointing_drops_the_norm_outputs_and_activation_functions():
    c = Context(micro_batch_size=1, precision="bf16", mp=1, layout="megatron", ac="selective")
    per_token = 2 * D * 2 + (Q + 2 * KV + Q) * 2 + 32 * 4 + 2 * F * 2  # residual inputs, attention, gate and up
    assert block_memory(LLAMA, DENSE, c).saved == pytest.approx(T * per_token)


def test_torchtitans_op_policy_keeps_every_other_matrix_products_output():
    """q (1st), v (3rd), w1 (5th) and w2 (7th) of q, k, v, o, w1, w3, w2; attention's output and LSE; the input."""
    c = Context(micro_batch_size=1, precision="bf16", mp=1, layout="megatron", ac="selective",
                selective_policy="every-other-mm")
    per_token = (D + Q + KV + F + D + Q) * 2 + 32 * 4
    m = block_memory(LLAMA, DENSE, c)
    assert m.saved == pytest.approx(T * per_token)
    assert m.recompute == pytest.approx(block_memory(LLAMA, DENSE, dataclasses.replace(c, ac="none")).saved - m.saved)
    # TP 8 with SP: column-parallel outputs per shard, w2's output whole before its reduce-scatter, the input and
    # both reduce-scatters' outputs sequence shards.
    sp = dataclasses.replace(c, mp=8, sequence_parallel=True)
    per_token = (D / 8 + Q / 8 + KV / 8 + F / 8 + D + 2 * D / 8 + Q / 8) * 2 + 32 / 8 * 4
    assert block_memory(LLAMA, DENSE, sp).saved == pytest.approx(T * per_token)


def test_sliding_layers_with_halos_hold_their_chunks_and_halos_not_the_gathered_sequence():
    """gpt-oss-20b (window 128, K/V width 512) at T 32,768 over cp 4: a sliding block keeps T/4 + 2 x 127 keys and
    values, a full block the whole sequence's; without halos (the published engines) both the whole sequence's."""
    shape = dataclasses.replace(DecoderShape.from_config(named_config("gpt-oss-20b")), seq_len=32768)
    c = Context(micro_batch_size=1, precision="bf16", cp=4)
    halos = dataclasses.replace(c, cp_halos=True)
    held = {kind: block_memory(shape, kind, halos).saved - block_memory(shape, kind, c).saved for kind in ("moe@128", "moe")}
    assert held["moe@128"] == pytest.approx(2 * 512 * (32768 / 4 + 2 * 127 - 32768) * 2)
    assert held["moe"] == 0
    assert block_memory(shape, "moe@128", halos).transient < block_memory(shape, "moe@128", c).transient


def test_context_parallelism_divides_what_every_token_saves_and_keeps_the_gathered_k_v():
    c = Context(micro_batch_size=1, precision="bf16", mp=2, layout="megatron")
    whole, split = block_memory(LLAMA, DENSE, c), block_memory(LLAMA, DENSE, dataclasses.replace(c, cp=4))
    gathered_kv = 2 * KV / 2 * T * 2  # the whole sequence's K and V of this TP shard, bf16
    assert split.saved == pytest.approx(whole.saved / 4 + gathered_kv)  # kept to attention's backward
    assert split.transient == pytest.approx(gathered_kv) and whole.transient == 0  # their gradients, built whole
    selective = block_memory(LLAMA, DENSE, dataclasses.replace(c, cp=4, ac="selective"))
    whole_selective = block_memory(LLAMA, DENSE, dataclasses.replace(c, ac="selective"))
    assert selective.saved == pytest.approx(whole_selective.saved / 4)  # gathered again in the backward, not kept
    assert selective.transient == pytest.approx(gathered_kv)  # the gradient (the new copy is recomputed)
    engine = dataclasses.replace(c, cp=4, ac="selective", layout="engine")
    assert block_memory(LLAMA, DENSE, engine).transient == pytest.approx(2 * gathered_kv)  # and a slice gradient
    cpu = block_memory(LLAMA, DENSE, dataclasses.replace(engine, split_cp_attention=True))
    assert cpu.saved - block_memory(LLAMA, DENSE, engine).saved == pytest.approx(T / 4 * 32 / 2 * (128 * 2 + 4))


def test_a_moe_block_saves_its_router_dispatched_copies_and_experts_on_sequence_shards():
    moe = dataclasses.replace(LLAMA, experts=Experts(64, 8, 2048, shared=1, shared_width=4096))
    c = Context(micro_batch_size=1, precision="bf16", mp=2, sequence_parallel=True, layout="megatron")
    attention_and_norms = 4 * D * 2 / 2 + (Q + 2 * KV + Q) / 2 * 2 + 32 / 2 * 4
    routed = 64 * 4 + 8 * (2 * D * 2 + 3 * 2048 * 2)  # fp32 logits; per copy: dispatched in and out, SwiGLU hidden
    shared = 3 * 4096 * 2
    expected = T * attention_and_norms + T / 2 * (routed + shared)  # expert TP 1: each rank dispatches T / mp
    m = block_memory(moe, MOE, c)
    assert m.saved == pytest.approx(expected)
    assert m.transient == pytest.approx(2 * 8 * D * 2 * T / 2)  # the dispatch's send and receive buffers


def test_megatrons_moe_recompute_keeps_only_the_mlps_input():
    """--recompute-modules layernorm moe: attention as under selective recompute, the MoE MLP its input (d per
    token on the rank's sequence shard); the rest is held while the block is recomputed."""
    moe = dataclasses.replace(LLAMA, experts=Experts(64, 8, 2048))
    c = Context(micro_batch_size=1, precision="bf16", mp=2, sequence_parallel=True, layout="megatron",
                ac="selective", selective_policy="products+moe")
    attention_and_norms = 2 * D * 2 / 2 + (Q + 2 * KV + Q) / 2 * 2 + 32 / 2 * 4  # the residual inputs: shards
    m = block_memory(moe, MOE, c)
    assert m.saved == pytest.approx(T * attention_and_norms + T / 2 * D * 2)
    assert m.recompute == pytest.approx(block_memory(moe, MOE, dataclasses.replace(c, ac="none")).saved - m.saved)
    kept_experts = block_memory(moe, MOE, dataclasses.replace(c, selective_policy="products")).saved
    assert kept_experts - m.saved == pytest.approx(T / 2 * (64 * 4 + 8 * (2 * D * 2 + 2 * 2048 * 2) - D * 2))
    assert block_memory(LLAMA, DENSE, c).saved == block_memory(  # a dense block is as under "products"
        LLAMA, DENSE, dataclasses.replace(c, selective_policy="products")).saved


def test_the_chunked_loss_holds_no_fp32_logits():
    c = Context(micro_batch_size=2, precision="bf16", mp=4)
    whole, chunked = head_memory(LLAMA, c), head_memory(LLAMA, dataclasses.replace(c, chunked_loss=True))
    rows = 128256 // 4
    norm = 2 * D * 4 + 4 + D * 2  # the final RMSNorm's fp32 input, normalised input, 1/rms and its output
    logits = 2 * T * rows * 2  # bf16, the stage's output
    # + the loss's per-token log-sum-exp, target column and masks (compiler/parallelize/cross_entropy.py)
    assert chunked.saved == pytest.approx(2 * T * (norm + SAVED_BYTES_PER_TOKEN) + logits)
    assert whole.saved == pytest.approx(2 * T * (norm + 4 * rows + 8) + logits)  # + the fp32 log-softmax
    # backward: the logits' gradient in bf16 and two fp32 chunks of rows, against two fp32 gradients of them all
    chunk = min(2 * T, chunk_rows(rows)) * rows
    assert chunked.transient == logits + 2 * 4 * chunk < whole.transient == 8 * 2 * T * rows


def test_a_dense_blocks_backward_holds_its_output_gradient_and_the_mlps_factor_gradients():
    """Measured with torch's memory profiler on the engine: the peak of a block's backward is its MLP's product
    backward, with the output's gradient (d, fp32 residual) and 3 f-wide gradients live and the down input
    (f) freed; GELU has one factor fewer. The engine layout only."""
    c = Context(micro_batch_size=2, precision="bf16", mp=8, sequence_parallel=True)
    assert mlp_backward_bytes(LLAMA, c) == pytest.approx(2 * T * (D * 4 / 8 + 2 * F / 8 * 2))
    gpt = dataclasses.replace(LLAMA, mlp="gelu")
    assert mlp_backward_bytes(gpt, dataclasses.replace(c, sequence_parallel=False)) == pytest.approx(
        2 * T * (D * 4 + F / 8 * 2))
    assert block_memory(LLAMA, DENSE, c).backward == mlp_backward_bytes(LLAMA, c)
    assert block_memory(LLAMA, DENSE, dataclasses.replace(c, layout="megatron")).backward == 0


def test_the_peak_is_the_heads_backward_or_a_blocks_after_the_head_freed_its_tensors():
    """One phase at a time: a rank holding the head peaks in the head's backward (its loss transient) or later
    in a block's, by which time the head kept only its logits (the stage's output)."""
    from compiler.parallel_plan import ParallelPlan
    from compiler.planner.cluster import load_cluster
    from compiler.planner.memory_model import DataParallelLayout, rank_memory
    from compiler.planner.search import Pricer

    shape = DecoderShape.from_flags(layers=4, d_model=256, heads=8, kv_heads=4, mlp="swiglu", mlp_width=1408,
                                    seq_len=8192, vocab_size=256)
    plan = ParallelPlan(dp=1, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=1, micro_batch_size=1,
                        precision="fp32")
    pricer = Pricer(shape, load_cluster("cpu-2core"))
    holding = next(iter(pricer.holdings("1f1b", 1, 1)))
    load = pricer._load(plan, holding)
    c = Context(1, "fp32", chunked_loss=True)
    head, block = head_memory(shape, c), block_memory(shape, DENSE, c)
    blocks_phase = block.backward - (head.saved - head.kept)
    assert blocks_phase > head.transient  # a wide MLP: the blocks' backward binds
    assert load.transient_bytes == pytest.approx(blocks_phase)
    narrow = dataclasses.replace(shape, mlp_width=256, d_model=512)
    load = Pricer(narrow, load_cluster("cpu-2core"))._load(plan, holding)
    c_head, c_block = head_memory(narrow, c), block_memory(narrow, DENSE, c)
    assert c_block.backward - (c_head.saved - c_head.kept) < c_head.transient == pytest.approx(load.transient_bytes)
    layout = DataParallelLayout()
    assert rank_memory(load, schedule="1f1b", p=1, m=1, v=1, rank=0, dense=layout, experts=layout).activations == \
        pytest.approx(load.saved_bytes + load.recompute_bytes + load.transient_bytes)


def test_the_engines_selective_checkpointing_keeps_a_moe_mlps_router_logits_and_prices_the_banded_forward():
    """The engine's SAC keeps matrix products and attention; a mixture's experts run as one grouped product (no kept
    op), so its MLP keeps only the router's fp32 logits and recomputes the rest; a full layer of gpt-oss's banded
    kernel holds its scores in the block's forward (compiler/planner/attention_memory.py)."""
    shape = DecoderShape.from_config(named_config("gpt-oss-debug", n_layers=2, d_model=256, n_heads=8, n_kv_heads=4,
                                                  seq_len=4096))
    full = shape.kinds()[1]
    c = Context(micro_batch_size=1, ac="selective", chunked_loss=True, moe_shards_need_sp=True)
    m, none = block_memory(shape, full, c), block_memory(shape, full, dataclasses.replace(c, ac="none"))
    per_token = 2 * 256 * 4 + engine_attention(shape, a=4, mp=1) + shape.experts.count * 4
    assert m.saved == pytest.approx(4096 * per_token + 2 * 4096 * shape.head_dim * 4)  # and RoPE's cos and sin
    assert m.recompute == pytest.approx(none.saved - m.saved)
    assert m.forward == none.forward == banded_scores_bytes(shape, full, micro_batch_size=1, mp=1) > 0
    assert block_memory(shape, shape.kinds()[0], c).forward < m.forward / 100  # a window of 8: 23 keys a chunk
