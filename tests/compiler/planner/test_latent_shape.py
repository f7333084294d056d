"""The planner's shape of a multi-head latent attention family (compiler/planner/shape.py reading the spec's
``LatentSizes``): DeepSeek-V3's parameters, activated parameters and FLOPs are the model's, its attention matrices
split over TP as the engine's plan splits them, context parallelism gathers its latent (the engine's rule,
compiler/context_gather.py) and pays kv_b over the whole sequence, and ``run.py plan`` prices it."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.cost import layer_costs
from compiler.planner.activations import analytic_layer_costs
from compiler.planner.cluster import load_cluster
from compiler.planner.collectives import all_gather_time
from compiler.planner.engines import THIS_ENGINE
from compiler.planner.layers import Setup, layer_table
from compiler.planner.shape import (
    DENSE,
    DecoderShape,
    activated_parameter_count,
    attention_matrices,
    block_params,
    model_flops_per_token,
    parameter_count,
)
from compiler.planner.work import block_work
from models import activated_parameter_count as model_activated
from models import flops_per_token, named_config
from models import parameter_count as model_parameters


@pytest.mark.parametrize("size", ["deepseek-v3-debug", "deepseek-v3-16b", "deepseek-v3"])
def test_the_shape_counts_the_models_parameters_and_flops(size):
    cfg = named_config(size)
    shape = DecoderShape.from_config(cfg)
    assert shape.latent == cfg.latent() and shape.kv_heads == shape.heads
    assert parameter_count(shape) == model_parameters(cfg)
    assert activated_parameter_count(shape) == model_activated(cfg)
    assert model_flops_per_token(shape) == flops_per_token(cfg)


@pytest.mark.parametrize("size", ["deepseek-v3", "deepseek-v3-16b"])
def test_tensor_parallelism_splits_the_heads_matrices_and_replicates_the_down_projections(size):
    shape = DecoderShape.from_config(named_config(size))
    s, d = shape.latent, shape.d_model
    mats = attention_matrices(shape, 8)
    assert mats["q"][1] == s.n_heads * s.qk_dim // 8 and mats["kv_b"] == (s.kv_lora_rank, s.n_heads * 256 // 8)
    assert mats["o"] == (s.n_heads * s.v_dim // 8, d) and mats["kv_a"] == (d, s.kv_lora_rank + s.rope_dim)
    assert ("q_a" in mats) == bool(s.q_lora_rank) and mats.get("q_a", (d, s.q_lora_rank)) == (d, s.q_lora_rank)
    whole, split = block_params(shape, 1), block_params(shape, 8)
    replicated = sum(i * o for name, (i, o) in mats.items() if name in ("q_a", "kv_a")) + s.norm_params() + 2 * d
    assert whole.total - split.total == pytest.approx((whole.total - replicated) * 7 / 8)  # a dense block


def test_run_py_plan_prices_deepseek_v3(run_main):
    from runtime.commands import plan

    code, out, err = run_main(plan.main, ["--model", "deepseek-v3", "--world", "2048", "--cluster", "h100-80gb", "--top", "1"])
    assert code == 0, err
    assert "671.03B parameters, 37.55B activated" in out and "s/step" in out


def test_context_parallelism_gathers_the_latent_and_runs_kv_b_over_the_whole_sequence():
    shape = DecoderShape.from_config(named_config("deepseek-v3"))  # T 4096, r 512 + rope 64, 128 heads x (192 + 128)
    h100 = load_cluster("h100-80gb")
    setup = dict(precision="bf16", micro_batch_size=1, mp=8, dp=1, pp=1)
    latent = 4096 * 576 * 2  # b T (r + rope) bf16, whatever mp: 71x fewer than 4096 x 128 x 320 values at mp 1
    link = h100.topology.group_link(4, 8)
    table = layer_table(shape, h100, THIS_ENGINE, Setup(cp=4, **setup))
    assert table.layers["moe"].cp == pytest.approx(2 * all_gather_time(latent, 4, link))
    full = layer_table(shape, h100, THIS_ENGINE, Setup(cp=4, ac="full", **setup))
    assert full.layers["moe"].cp == pytest.approx(3 * all_gather_time(latent, 4, link))  # gathered again

    def kv_b_flops(cp: int) -> float:
        work = block_work(shape, "moe", micro_batch_size=1, mp=8, cp=cp, ep=1, precision="bf16",
                          sequence_parallel=False, traits=THIS_ENGINE)
        return sum(g.flops for g in work.gemms if (g.k, g.n) == (512, 128 * 256 // 8))  # kv_b: [., r] x [r, H/mp 256]

    # each of 4 ranks expands all 4096 tokens (T rows where its other products run T/4): 4x one rank's share
    assert kv_b_flops(4) == kv_b_flops(1) == 2 * 4096 * 512 * 128 * 256 / 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("q_lora_rank", [0, 32])
def test_a_latent_blocks_saved_bytes_are_what_the_engine_saves(precision, mp, q_lora_rank):
    """The closed form of multi-head latent attention's saved tensors (compiler/planner/activations.py) against
    compiler/cost.py's count on the engine's dense DeepSeek-V3 block. v's head dim equals q's and k's here, so the
    CPU runs the flash kernel (output and log-sum-exp, as GPU kernels keep): with a narrower v it takes the math
    path, which keeps the (T, T) probabilities no GPU run keeps."""
    cfg = dataclasses.replace(named_config("deepseek-v3-debug"), v_head_dim=16, q_lora_rank=q_lora_rank)
    counted = layer_costs(cfg, micro_batch_size=2, precision=precision, mp=mp)
    analytic = analytic_layer_costs(DecoderShape.from_config(cfg), micro_batch_size=2, precision=precision, mp=mp)
    dense = [i for i, kind in enumerate(DecoderShape.from_config(cfg).kinds()) if kind == DENSE]
    assert dense
    for i in dense:
        assert analytic[1 + i].activation_bytes == pytest.approx(counted[1 + i].activation_bytes, rel=1e-3)
