"""The gpt-oss family's sizes (models/gpt_oss/config.py): the released configs and their published parameter counts,
FLOPs per token against the built model (a sliding layer's attention over its window), the layer types under flag
overrides, the checks that name a flag, and the meta-device trace against the eager model (no head count in the
graph, as tensor parallelism needs)."""

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
from models.gpt_oss.config import FULL, SLIDING

# The model card's table 1 (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): total parameters 116.83B and
# 20.91B, active parameters per token 5.13B and 3.61B. The convention that gives them: the totals count every
# parameter (embedding and unembedding both: untied); the active counts take 4 of each block's experts (their
# biases too) and count the unembedding but not the embedding table (a lookup, no product).
PUBLISHED = {"gpt-oss-20b": (20_914_757_184, 3_608_307_264), "gpt-oss-120b": (116_829_156_672, 5_132_849_472)}


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_named_sizes_have_the_published_parameter_counts(size):
    cfg = named_config(size)
    total, active = PUBLISHED[size]
    assert parameter_count(cfg) == total
    assert activated_parameter_count(cfg) - cfg.vocab_size * cfg.d_model == active
    assert round(total / 1e9, 2) == {"gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83}[size]
    assert round(active / 1e9, 2) == {"gpt-oss-20b": 3.61, "gpt-oss-120b": 5.13}[size]
    assert spec_of(cfg).check(cfg, 8) is None  # 64 heads and 8 key/value heads split 8 ways


def test_the_published_sizes_are_the_released_configs():
    small, large = named_config("gpt-oss-20b"), named_config("gpt-oss-120b")
    for cfg, (layers, experts) in ((small, (24, 32)), (large, (36, 128))):
        assert (cfg.n_layers, cfg.n_experts) == (layers, experts)
        assert (cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads, cfg.top_k, cfg.mlp_width, cfg.vocab_size) == (
            2880, 64, 64, 8, 4, 2880, 201088)
        assert (cfg.sliding_window, cfg.rope_theta, cfg.swiglu_limit, cfg.context) == (128, 150000.0, 7.0, 131072)
        assert (cfg.rope_yarn.factor, cfg.rope_yarn.original_context, cfg.rope_yarn.truncate) == (32.0, 4096, False)
        assert cfg.layer_types == tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers))
        assert not cfg.tie_embeddings


@pytest.mark.parametrize("size", ["gpt-oss-debug", "gpt-oss-20b", "gpt-oss-120b"])
def test_flops_per_token_count_a_tokens_products_and_each_layers_keys(size):
    cfg = named_config(size, seq_len=512)
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
    n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_emb.weight")
    for m in model.modules():
        if isinstance(m, MoE):
            n -= sum(p.numel() for p in m.experts.parameters()) * (m.experts.n_experts - m.top_k) // m.experts.n_experts
    keys = sum(cfg.seq_len if kind == FULL else min(cfg.seq_len, cfg.sliding_window) for kind in cfg.layer_types)
    assert flops_per_token(cfg) == 6 * n + 12 * keys * cfg.n_heads * cfg.head_dim
    assert keys < cfg.n_layers * cfg.seq_len  # the sliding layers are cheaper


def test_another_layer_count_keeps_the_alternation_and_a_shape_flag_keeps_the_head_dimension():
    cfg = named_config("gpt-oss-debug", n_layers=6, d_model=96, seq_len=128)
    assert cfg.layer_types == (SLIDING, FULL) * 3 and cfg.head_dim == 16 and cfg.context == 128
    assert [cfg.window(i) for i in range(3)] == [8, None, 8]
    kept = dataclasses.replace(cfg, sliding_layers=(1,))  # not alternating: another count keeps the indices
    assert spec_of(cfg).with_overrides(kept, n_layers=3).layer_types == (FULL, SLIDING, FULL)


@pytest.mark.parametrize(("overrides", "mp", "words"), [
    ({}, 4, ["--mp 4", "key/value head count (--kv-heads 2)", "valid --mp values: 1, 2"]),
    ({"n_heads": 6, "n_kv_heads": 4}, 1, ["--kv-heads 4", "--heads 6"]),
])
def test_the_checks_name_the_flag(overrides, mp, words):
    from runtime.config import ConfigError, _check_model

    cfg = named_config("gpt-oss-debug", **overrides)
    with pytest.raises(ConfigError) as raised:
        _check_model(cfg, mp)
    assert all(w in str(raised.value) for w in words), str(raised.value)


def test_the_meta_built_model_traces_into_stages_that_compute_the_eager_model_without_a_head_count():
    # 5 heads over 5 key/value heads: no other size is 5, so a 5 in the graph's shapes would be the head count
    cfg = named_config("gpt-oss-debug", n_heads=5, n_kv_heads=5, seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        example = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=[1, 3])  # sliding | full, sliding, full
    stages = [pipe.get_stage_module(i) for i in range(2)]
    for stage in stages:
        restore_linear_modules(stage, model)
        stage.to_empty(device="cpu")
        init_weights(stage, seed=9, cfg=cfg)
    reference = build_model(cfg, seed=9).eval()  # evaluation mode: the MoE's load counts stay eager-only
    for name, p in reference.named_parameters():  # biases and sinks away from their zero start
        if name.endswith(("bias", "sinks.weight")):
            with torch.no_grad():
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
                dict(stages[0].named_parameters()).get(name, dict(stages[1].named_parameters()).get(name)).copy_(p)
    got, want = stages[1](stages[0](tokens)), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    graph = str(stages[0].get_submodule("layers.0.attn").graph)
    assert f"[2, {cfg.seq_len}, -1, {cfg.head_dim}]" in graph and ", 5," not in graph and "device" not in graph
