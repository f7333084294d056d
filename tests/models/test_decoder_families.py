"""The Qwen3, Qwen3-MoE and Mixtral families beyond their fixtures (tests/models/test_hf_fixtures_moe.py): named sizes
against the published parameter counts (total and activated), FLOPs per token against the built model, both
config.json generations, the configs refused with the key named, the meta-device trace against the eager model,
tensor-parallel shards of grouped-query attention, and the checks that name a flag."""

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
from models.common.attention import Attention
from models.common.rope import Rope
from runtime.commands.train import InputError, check_inputs
from runtime.distributed.process_group import LaunchEnv

# (total, activated, non-embedding) parameters as the model cards state them: Qwen3's cards ("Number of Parameters:
# 0.6B; Number of Paramaters (Non-Embedding): 0.44B", ..., "30.5B in total and 3.3B activated", "235B in total and
# 22B activated"), Mistral's announcements (Mixtral 8x7B: "46.7B total parameters but only uses 12.9B parameters per
# token"; 8x22B: "39B active parameters out of 141B"). None: not stated (a dense model activates all).
PUBLISHED = {
    "qwen3-0.6b": ("0.6B", None, "0.44B"), "qwen3-1.7b": ("1.7B", None, "1.4B"), "qwen3-4b": ("4.0B", None, "3.6B"),
    "qwen3-8b": ("8.2B", None, "6.95B"), "qwen3-14b": ("14.8B", None, "13.2B"), "qwen3-32b": ("32.8B", None, "31.2B"),
    "qwen3-30b-a3b": ("30.5B", "3.3B", "29.9B"), "qwen3-235b-a22b": ("235B", "22B", "234B"),
    "mixtral-8x7b": ("46.7B", "12.9B", None), "mixtral-8x22b": ("141B", "39B", None),
}


def _agrees(count: int, published: str | None) -> bool:
    """``count`` is what ``published`` states: within one unit of its last digit (cards round, or cut: Qwen3-30B-A3B
    activates 3.35B and says 3.3B)."""
    if published is None:
        return True
    decimals = len(published[:-1].partition(".")[2])
    return abs(count / 1e9 - float(published[:-1])) < 10.0 ** -decimals


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_named_sizes_have_the_published_parameter_counts(size):
    cfg = named_config(size)
    total, activated, non_embedding = PUBLISHED[size]
    embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert _agrees(parameter_count(cfg), total), parameter_count(cfg)
    assert _agrees(activated_parameter_count(cfg), activated or total), activated_parameter_count(cfg)
    assert _agrees(parameter_count(cfg) - embeddings, non_embedding), parameter_count(cfg) - embeddings
    assert spec_of(cfg).check(cfg, 4) is None  # the published head counts split 4 ways


@pytest.mark.parametrize("size", ["qwen3-debug", "qwen3-8b", "qwen3-moe-debug", "qwen3-30b-a3b", "mixtral-debug",
                                  "mixtral-8x7b"])
def test_flops_per_token_counts_a_tokens_matrix_products(size):
    cfg = named_config(size)
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
    # Every parameter but the embedding lookup; of each MoE block's experts, k of E.
    n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_emb.weight")
    for m in model.modules():
        if isinstance(m, MoE):
            n -= sum(p.numel() for p in m.experts.parameters()) * (m.experts.n_experts - m.top_k) // m.experts.n_experts
    attention = 12 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
    assert flops_per_token(cfg) == 6 * n + attention


def _config_4x(written: dict) -> dict:
    """config.json as transformers 4.x wrote it, from its documentation: rope_theta (no rope_parameters),
    torch_dtype, and num_experts for Qwen3-MoE (Mixtral's num_local_experts is the same in both)."""
    dropped = ("rope_parameters", "dtype", *(("num_local_experts",) if written["model_type"] == "qwen3_moe" else ()))
    return {**{k: v for k, v in written.items() if k not in dropped}, "torch_dtype": "bfloat16"}


def _config_5x(written: dict) -> dict:
    """As transformers 5.x writes it: rope_parameters, dtype, num_local_experts (the fixtures' spellings)."""
    return {k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype", "num_experts")}


@pytest.mark.parametrize("size", ["qwen3-debug", "qwen3-4b", "qwen3-moe-debug", "qwen3-235b-a22b", "mixtral-8x22b"])
def test_both_config_json_generations_read_to_the_same_config(size):
    cfg = named_config(size)
    hf = spec_of(cfg).hf
    written = hf.config_to_hf(cfg)
    assert written["rope_parameters"] == {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    assert written["rope_theta"] == cfg.rope_theta and written["dtype"] == written["torch_dtype"]
    # How the engine initialises a fresh model (the debug sizes' wide router) is no part of a Hugging Face config.
    fresh = dataclasses.replace(cfg, router_init_std=0.02) if hasattr(cfg, "router_init_std") else cfg
    for config in (written, _config_4x(written), _config_5x(written)):
        assert hf.config_from_hf(config) == fresh
    if cfg.family == "qwen3_moe":
        assert written["num_experts"] == written["num_local_experts"] == cfg.n_experts


@pytest.mark.parametrize(("size", "change", "key"), [
    ("qwen3-debug", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3-debug", {"attention_bias": True}, "attention_bias"),
    ("qwen3-debug", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3-debug", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3-debug", {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ("qwen3-moe-debug", {"num_local_experts": None}, "num_local_experts"),
    ("qwen3-moe-debug", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("mixtral-debug", {"sliding_window": 4096}, "sliding_window"),
    ("mixtral-debug", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral-debug", {"num_experts_per_tok": None}, "num_experts_per_tok"),
])
def test_configs_these_models_would_compute_differently_are_refused_naming_the_key(size, change, key):
    cfg = named_config(size)
    config = {**spec_of(cfg).hf.config_to_hf(cfg), **change}
    config = {k: v for k, v in config.items() if v is not None}
    if key == "num_local_experts":
        config.pop("num_experts")
    with pytest.raises(ValueError, match=key):
        spec_of(cfg).hf.config_from_hf(config)


@pytest.mark.parametrize("size", ["qwen3-debug", "qwen3-moe-debug", "mixtral-debug"])
def test_the_meta_built_model_traces_into_stages_that_compute_the_eager_model(size):
    cfg = dataclasses.replace(named_config(size, n_layers=2, seq_len=32), tie_embeddings=False)
    if cfg.family == "qwen3_moe":
        cfg = dataclasses.replace(cfg, mlp_only_layers=(1,))  # a dense block in the other stage
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        example = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=[1, 1])
    stages = [pipe.get_stage_module(i) for i in range(2)]
    for stage in stages:
        restore_linear_modules(stage, model)
        stage.to_empty(device="cpu")
        init_weights(stage, seed=9, cfg=cfg)
    # Evaluation mode: a traced graph keeps neither the load counts nor the auxiliary loss's backward
    # (models/common/moe.py), which the engine runs on the eager module.
    reference = build_model(cfg, seed=9).eval()
    got, want = stages[1](stages[0](tokens)), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    if cfg.family == "qwen3":  # bf16 at run time: the q/k norms upcast inside the graph as eagerly (F.rms_norm)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(stages[1](stages[0](tokens)), reference(tokens), rtol=0, atol=0)
    graph = str(stages[0].get_submodule("layers.0.attn").graph)
    assert f"[2, {cfg.seq_len}, -1, {cfg.head_dim}]" in graph and "device" not in graph


@pytest.mark.parametrize("qk_norm", [None, 1e-6])
def test_a_tensor_parallel_shard_of_grouped_query_attention_computes_its_heads(qk_norm):
    """A rank holding H/mp query heads and Hkv/mp key/value heads (column-parallel q, k, v; row-parallel o) gives
    its share of the output: the shards' partial outputs sum to the whole attention's."""
    d, heads, kv_heads, hd, mp = 32, 8, 2, 8, 2
    rope = Rope(theta=10000.0, factor=None)
    whole = Attention(d_model=d, n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, rope=rope, qk_norm_eps=qk_norm)
    x = torch.randn(2, 12, d, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(2, 12, d)
    for rank in range(mp):
        shard = Attention(d_model=d, n_heads=heads // mp, n_kv_heads=kv_heads // mp, head_dim=hd, rope=rope,
                          qk_norm_eps=qk_norm)
        q_rows, kv_rows = slice(rank * heads * hd // mp, (rank + 1) * heads * hd // mp), slice(
            rank * kv_heads * hd // mp, (rank + 1) * kv_heads * hd // mp)
        with torch.no_grad():
            shard.q.weight.copy_(whole.q.weight[q_rows])
            shard.k.weight.copy_(whole.k.weight[kv_rows])
            shard.v.weight.copy_(whole.v.weight[kv_rows])
            shard.o.weight.copy_(whole.o.weight[:, q_rows])
            if qk_norm:
                shard.q_norm.weight.copy_(whole.q_norm.weight)
                shard.k_norm.weight.copy_(whole.k_norm.weight)
            total += shard(x)
    with torch.no_grad():
        torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "flags", "words"), [
    ("qwen3-debug", ["--dp", "2", "--ep", "2"], ["--ep 2", "qwen3", "mixture-of-experts"]),
    ("qwen3-moe-debug", ["--dp", "2", "--ep", "4"], ["--ep 4", "--dp 2", "valid --ep values: 1, 2"]),
    ("mixtral-debug", ["--dp", "6", "--ep", "3"], ["--ep 3", "8 experts", "valid --ep values: 1, 2"]),
    ("qwen3-moe-debug", ["--mp", "2", "--sequence-parallel"], None),
    ("mixtral-debug", ["--mp", "4"], ["--mp 4", "key/value head count (--kv-heads 2)"]),
    ("qwen3-debug", ["--mp", "2", "--mlp-width", "101"], ["--mp 2", "--mlp-width 101"]),
    ("mixtral-debug", ["--mp", "2"], None),
    ("qwen3-debug", ["--mp", "2", "--sequence-parallel"], None),
])
def test_the_checks_name_the_flag_before_any_process_group(model, flags, words):
    nproc = int(flags[flags.index("--mp") + 1]) if "--mp" in flags else int(flags[flags.index("--dp") + 1])
    argv = ["--model", model, "--steps", "1", *flags]
    env = LaunchEnv(rank=0, world_size=nproc, local_rank=0, local_world_size=nproc)
    if words is None:
        check_inputs(argv, env)
        return
    with pytest.raises(InputError) as raised:
        check_inputs(argv, env)
    line = str(raised.value)
    assert "\n" not in line and all(w in line for w in words), line
