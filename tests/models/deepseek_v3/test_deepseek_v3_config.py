"""The DeepSeek-V3 family's sizes (models/deepseek_v3/config.py): the published parameter counts, FLOPs per token
against the built model, the checks that name a flag, and the meta-device trace against the eager model with no
head count in its graph (what tensor parallelism needs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiler.parallelize.tensor_parallel import restore_linear_modules
from compiler.trace import trace_pipeline
from models import (
    MoE,
    activated_parameter_count,
    build_model,
    flops_per_token,
    init_weights,
    named_config,
    parameter_count,
    spec_of,
)
from tests.models.test_decoder_families import _agrees

# (total, activated) as DeepSeek states them, activated without the embedding lookup (the V3 report's abstract:
# "671B total parameters with 37B activated for each token"; DeepSeek-V2-Lite's card: "15.7B total parameters,
# 2.4B activated" (2.66B with the token embedding, 2.45B without)). V3's counts leave out its MTP module (14B).
PUBLISHED = {"deepseek-v3": ("671B", "37B"), "deepseek-v3-16b": ("15.7B", "2.4B")}


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_named_sizes_have_the_published_parameter_counts(size):
    cfg = named_config(size)
    total, activated = PUBLISHED[size]
    lookup = cfg.vocab_size * cfg.d_model
    assert _agrees(parameter_count(cfg), total), parameter_count(cfg)
    assert _agrees(activated_parameter_count(cfg) - lookup, activated), activated_parameter_count(cfg) - lookup
    assert spec_of(cfg).check(cfg, 8) is None  # the published head counts split 8 ways


def test_the_published_sizes_are_their_configs():
    v3, lite = named_config("deepseek-v3"), named_config("deepseek-v3-16b")
    assert (v3.n_layers, v3.d_model, v3.n_heads, v3.q_lora_rank, v3.kv_lora_rank, v3.n_experts, v3.top_k,
            v3.n_group, v3.topk_group, v3.n_shared_experts, v3.first_k_dense, v3.routed_scaling_factor) == (
        61, 7168, 128, 1536, 512, 256, 8, 8, 4, 1, 3, 2.5)
    assert (v3.rope_yarn.factor, v3.rope_yarn.original_context) == (40.0, 4096)
    assert v3.softmax_factor() == pytest.approx(1.874, abs=1e-3)
    assert v3.softmax_factor() == pytest.approx(1.874, abs=1e-3)
    assert (lite.n_layers, lite.d_model, lite.n_heads, lite.q_lora_rank, lite.n_experts, lite.top_k,
            lite.n_shared_experts, lite.expert_width, lite.mlp_width, lite.vocab_size) == (
        27, 2048, 16, 0, 64, 6, 2, 1408, 10944, 102400)


@pytest.mark.parametrize("size", ["deepseek-v3-debug", "deepseek-v3-16b", "deepseek-v3"])
def test_flops_per_token_counts_a_tokens_matrix_products(size):
    cfg = named_config(size)
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
    n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_emb.weight" and p.requires_grad)
    for m in model.modules():
        if isinstance(m, MoE):
            n -= sum(p.numel() for p in m.experts.parameters()) * (m.experts.n_experts - m.top_k) // m.experts.n_experts
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    attention = 6 * cfg.n_layers * cfg.seq_len * cfg.n_heads * (qk + v)  # QK^T over qk features, AV over v
    assert flops_per_token(cfg) == 6 * n + attention


@pytest.mark.parametrize(("overrides", "mp", "words"), [
    ({}, 3, ["--mp 3", "--heads 4", "valid --mp values: 1, 2, 4"]),
    ({"n_heads": 8, "mlp_width": 100}, 8, ["--mp 8", "--mlp-width 100"]),
])
def test_the_checks_name_the_flag(overrides, mp, words):
    """The family states the problem in config fields; the engine's edge (runtime/config.py) names the flags."""
    from runtime.config import ConfigError, _check_model

    cfg = named_config("deepseek-v3-debug", **overrides)
    assert spec_of(cfg).check(cfg, mp) is not None
    with pytest.raises(ConfigError) as raised:
        _check_model(cfg, mp)
    assert all(w in str(raised.value) for w in words), str(raised.value)


def test_kv_heads_is_refused_and_the_latent_sizes_stay():
    with pytest.raises(ValueError, match="--kv-heads 2: multi-head latent attention"):
        named_config("deepseek-v3-debug", n_kv_heads=2)
    cfg = named_config("deepseek-v3-debug", d_model=96, n_heads=6, seq_len=128)
    assert cfg.latent() == dataclasses.replace(named_config("deepseek-v3-debug").latent(), n_heads=6)
    assert cfg.n_kv_heads == 6 and cfg.context == 128


def test_the_meta_built_model_traces_into_stages_that_compute_the_eager_model_without_a_head_count():
    # 5 heads: no other size of the model is 5, so a 5 in the graph's shapes would be the head count, which a
    # tensor-parallel shard (H / mp heads) could not run.
    cfg = named_config("deepseek-v3-debug", n_heads=5, seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        example = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=[1, 2])  # dense | MoE blocks
    stages = [pipe.get_stage_module(i) for i in range(2)]
    for stage in stages:
        restore_linear_modules(stage, model)
        stage.to_empty(device="cpu")
        init_weights(stage, seed=9, cfg=cfg)
    reference = build_model(cfg, seed=9).eval()  # evaluation mode: the MoE's load counts stay eager-only
    got, want = stages[1](stages[0](tokens)), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    graph = stages[0].get_submodule("layers.0.attn").graph
    shapes = [a for node in graph.nodes for a in node.args if isinstance(a, (list, tuple)) and a
              and all(isinstance(i, int) for i in a)]
    assert [2, cfg.seq_len, -1, 16] in [list(s) for s in shapes]  # q's heads: -1
    assert not [s for s in shapes if cfg.n_heads in s], shapes
    assert "device" not in str(graph)
