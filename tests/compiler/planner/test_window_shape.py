"""The planner's shape of a family with sliding-window layers, attention sinks and biased routers (gpt-oss;
compiler/planner/shape.py reading the spec's ``attention_windows`` and ``Architecture.sinks``): parameters, activated
parameters and FLOPs are the model's, a sliding block is a kind of its own whose attention runs over its window (T x W,
not T^2), as the cost model counts it on the engine's model, and ``run.py plan`` prices gpt-oss-120b."""

from __future__ import annotations

import pytest

from compiler.cost import layer_costs
from compiler.planner.shape import (
    MOE,
    DecoderShape,
    activated_parameter_count,
    block_forward_flops,
    block_params,
    mlp_kind,
    model_flops_per_token,
    parameter_count,
    window_of,
)
from models import activated_parameter_count as model_activated
from models import flops_per_token, named_config
from models import parameter_count as model_parameters


@pytest.mark.parametrize("size", ["gpt-oss-debug", "gpt-oss-20b", "gpt-oss-120b"])
def test_the_shape_counts_the_models_parameters_and_flops(size):
    cfg = named_config(size)
    shape = DecoderShape.from_config(cfg)
    assert shape.sinks and shape.biases
    assert parameter_count(shape) == model_parameters(cfg)
    assert activated_parameter_count(shape) == model_activated(cfg)
    assert model_flops_per_token(shape) == flops_per_token(cfg)


def test_sliding_blocks_are_a_kind_of_their_own_attending_over_their_window():
    shape = DecoderShape.from_config(named_config("gpt-oss-120b"))
    assert shape.kinds()[:3] == ["moe@128", "moe", "moe@128"]
    assert [mlp_kind(k) for k in shape.kinds()[:2]] == [MOE, MOE] and window_of("moe@128") == 128
    (matmul_s, sliding), (matmul_f, full) = (block_forward_flops(shape, micro_batch_size=1, mp=8, kind=k)
                                             for k in ("moe@128", "moe"))
    assert matmul_s == matmul_f and sliding * shape.seq_len == full * 128  # T x W against T x T
    assert block_params(shape, 8, kind="moe@128") == block_params(shape, 8, kind="moe")
    # q/k/v's columns and biases, o's rows and the sinks split 8 ways; o's bias, the norms and the router replicated
    whole, split = block_params(shape, 1, kind=MOE), block_params(shape, 8, kind=MOE)
    split_weights = (2 * shape.q_width + 2 * shape.kv_width) * shape.d_model
    assert whole.dense - split.dense == (split_weights + shape.q_width + 2 * shape.kv_width + shape.heads) * 7 // 8


def test_the_cost_model_counts_each_layer_types_attention_on_the_engines_model():
    """compiler/cost.py profiles one sliding and one full block; their attention FLOPs differ by what the banded
    chunks compute: T x (window + chunk - 1) pairs against T x (T + chunk) / 2."""
    cfg = named_config("gpt-oss-debug", seq_len=256)
    costs = layer_costs(cfg, micro_batch_size=1)
    blocks = costs[1:-1]
    assert blocks[0].flops == blocks[2].flops and blocks[1].flops == blocks[3].flops
    shape = DecoderShape.from_config(cfg)
    matmul, _ = block_forward_flops(shape, micro_batch_size=1, kind="moe@8")
    width, t = shape.q_width, cfg.seq_len
    chunk = 16  # half the window of 8, at least 16
    sliding_pairs = sum((min(c + chunk, t) - c) * (min(c + chunk, t) - max(0, c - 7)) for c in range(0, t, chunk))
    full_pairs = sum((min(c + 128, t) - c) * min(c + 128, t) for c in range(0, t, 128))
    # 2 (hd + hd) per pair forward, 2 (3 hd + 2 hd) backward, per head: 14 hd per pair and head
    attention = blocks[1].flops - blocks[0].flops
    assert attention == 14 * width * (full_pairs - sliding_pairs)
    assert blocks[0].flops < blocks[1].flops and sliding_pairs < 3 * cfg.sliding_window * t


def test_run_py_plan_prices_gpt_oss_120b(capsys):
    from runtime.commands import plan

    assert plan.main(["--model", "gpt-oss-120b", "--world", "64", "--cluster", "h100-80gb", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "116.83B parameters, 5.71B activated" in out and "s/step" in out
