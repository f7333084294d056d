"""Per-layer costs: counted FLOPs match the analytic count, TP shards divide the work, autocast halves activations."""

import dataclasses

import pytest
import torch

from compiler.cost import layer_costs
from models import named_config, spec_of
from runtime.observe.layer_timing import measure_layer_times

CFG = named_config("tiny", n_layers=3, d_model=64, n_heads=4, seq_len=32, vocab_size=512, mlp_width=256)


def test_block_flops_match_the_matmul_count():
    B, T, d, f = 2, CFG.seq_len, CFG.d_model, CFG.mlp_width
    costs = layer_costs(CFG, micro_batch_size=B)
    assert [c.name for c in costs] == ["embedding", "layers.0", "layers.1", "layers.2", "head"]
    matmuls = 2 * B * T * (4 * d * d + 2 * d * f)  # q, k, v, o and the MLP, forward
    attention = 4 * B * T * T * d  # Q K^T and attention x V, forward (counted as the full square)
    # Backward: 2 x forward for the matmuls; 5 products instead of 2 for attention (scores recomputed).
    assert costs[1].flops == pytest.approx(3 * matmuls + 3.5 * attention, rel=0.02)
    assert costs[-1].flops == pytest.approx(3 * 2 * B * T * d * CFG.vocab_size, rel=0.05)
    assert costs[1].params == sum(p.numel() for p in torch.nn.Module.parameters(_block()))


def _block():
    return spec_of(CFG).build(CFG).layers["0"]


def test_tensor_parallel_shard_divides_matmul_flops_and_params():
    full = layer_costs(CFG, micro_batch_size=2)[1]
    half = layer_costs(CFG, micro_batch_size=2, mp=2)[1]
    assert half.flops == pytest.approx(full.flops / 2, rel=0.02)
    assert half.params < full.params / 2 + 4 * CFG.d_model  # replicated norms and row-parallel biases
    assert half.activation_bytes < full.activation_bytes


def test_autocast_saves_fewer_activation_bytes_and_reports_weight_copies():
    fp32 = layer_costs(CFG, micro_batch_size=2, precision="fp32")[1]
    bf16 = layer_costs(CFG, micro_batch_size=2, precision="bf16")[1]
    assert 1.5 < fp32.activation_bytes / bf16.activation_bytes < 2.0  # the fp32 residual stream stays
    assert fp32.weight_copy_bytes == 0 and bf16.weight_copy_bytes > 0


def test_costs_scale_linearly_with_the_micro_batch():
    one, four = layer_costs(CFG, micro_batch_size=1)[1], layer_costs(CFG, micro_batch_size=4)[1]
    assert four.flops == pytest.approx(4 * one.flops) and four.activation_bytes == 4 * one.activation_bytes


def test_measured_time_mode_times_every_group():
    costs = measure_layer_times(named_config("tiny"), micro_batch_size=2, precision="fp32", device=torch.device("cpu"),
                                repeats=1)
    assert all(c.seconds and c.seconds > 0 for c in costs)
    assert len(costs) == named_config("tiny").n_layers + 2  # embedding, blocks, head


def test_measured_time_mode_times_the_head_with_its_loss(monkeypatch):
    # The last stage computes the loss: at a large vocabulary its softmax over [b*t, vocab] logits costs
    # as much as several blocks, so timing the head without it underestimates the last stage.
    shapes = {}

    def record_shape(forward, precision, device, repeats):
        out = forward()
        shapes[len(shapes)] = tuple(out.shape)
        return float(len(shapes))

    monkeypatch.setattr("runtime.observe.layer_timing._time_fwd_bwd", record_shape)
    cfg = named_config("tiny")
    measure_layer_times(cfg, micro_batch_size=2, precision="fp32", device=torch.device("cpu"))
    assert shapes == {0: (2, cfg.seq_len, cfg.d_model), 1: (2, cfg.seq_len, cfg.d_model), 2: ()}


def test_a_mixture_counts_its_activated_experts_and_each_block_kind_on_its_own():
    # Qwen3-MoE with block 1 dense (mlp_only_layers): two block kinds, each profiled on its own.
    moe_cfg = dataclasses.replace(named_config("qwen3-moe-debug", n_layers=3, seq_len=32), mlp_only_layers=(1,))
    B, T, d, c = 2, moe_cfg.seq_len, moe_cfg.d_model, moe_cfg
    costs = layer_costs(moe_cfg, micro_batch_size=B)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attention = 2 * B * T * (2 * d * q + 2 * d * kv) * 3 + 3.5 * 4 * B * T * T * q  # projections, QK^T and AV
    routed = 2 * B * T * (d * c.n_experts + c.top_k * 3 * d * c.expert_width)  # router; k experts per token
    dense = 2 * B * T * 3 * d * c.mlp_width
    assert costs[1].flops == costs[3].flops == pytest.approx(attention + 3 * routed, rel=1e-6)
    assert costs[2].flops == pytest.approx(attention + 3 * dense, rel=1e-6)
    moe_block = spec_of(moe_cfg).build(moe_cfg).layers["0"]
    assert costs[1].params == sum(p.numel() for p in moe_block.parameters())  # all E experts held
    # Tensor parallelism splits the attention, not the experts (they are replicated or expert-sharded).
    half = layer_costs(moe_cfg, micro_batch_size=B, mp=2)[1]
    assert half.flops == pytest.approx(attention / 2 + 3 * routed, rel=1e-6)
