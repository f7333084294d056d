"""The Llama 3 family: a forward written here from Hugging Face's LlamaForCausalLM math (itself checked against
transformers' own logits in tests/models/test_hf_fixtures.py, which also runs our model on a folder transformers wrote:
tied, grouped-query, Llama 3.1 scaling) gives our logits on the variants that folder does not have (untied, a
short original context, plain RoPE, a head_dim other than d/h); both config.json generations read alike; Meta's
widths and parameter counts; overrides; document masking; the meta-device trace; the tensor-parallel checks'
messages."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from compiler.parallelize.tensor_parallel import restore_linear_modules
from compiler.trace import trace_pipeline
from models import build_model, flops_per_token, init_weights, named_config, parameter_count, spec_of
from models.common.norm import RMSNorm
from models.common.rope import Rope, inverse_frequencies
from models.llama3.config import ffn_width
from models.spec import MP, ShapeProblem
from runtime.commands.train import InputError, check_inputs
from runtime.distributed.process_group import LaunchEnv
from runtime.engine.data.inputs import document_ids

DEBUG = named_config("llama3-debug")
SPEC = spec_of(DEBUG)
HF = SPEC.hf


# ---- an independent reference: Hugging Face's Llama computed from config.json and the HF state dict ----

def reference_inv_freq(config: dict) -> torch.Tensor:
    """RoPE rates from config.json (4.x keys): theta ** (-2i / head_dim); with rope_type "llama3" each rate is
    rescaled one by one as Meta's apply_scaling does (kept above the high-frequency wavelength bound, divided
    by the factor below the low one, interpolated between), in Python floats."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rates = [1.0 / config["rope_theta"] ** (i / head_dim) for i in range(0, head_dim, 2)]
    scaling = config.get("rope_scaling")
    if scaling and scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        scaled = []
        for rate in rates:
            wavelength = 2 * math.pi / rate
            if wavelength < context / high:
                scaled.append(rate)
            elif wavelength > context / low:
                scaled.append(rate / factor)
            else:
                smooth = (context / wavelength - low) / (high - low)
                scaled.append((1 - smooth) * rate / factor + smooth * rate)
        rates = scaled
    return torch.tensor(rates, dtype=torch.float32)


def llama_forward(hf: dict[str, torch.Tensor], config: dict, tokens: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's forward: RMSNorm in fp32, q/k/v/o projections, rotate-half RoPE at positions 0..T-1,
    key/value heads repeated (head h serves query heads h*g .. h*g+g-1), causal softmax attention written out,
    SwiGLU, the head (embed_tokens when tied)."""
    d, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps = config.get("head_dim") or d // heads, config["rms_norm_eps"]
    B, T = tokens.shape

    def rms_norm(x, name):
        x32 = x.to(torch.float32)
        return hf[name] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)

    angles = torch.arange(T, dtype=torch.float32)[:, None] * reference_inv_freq(config)[None, :]  # (T, hd/2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # (T, hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = hf["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms_norm(x, f"{p}.input_layernorm.weight")
        q = (h @ hf[f"{p}.self_attn.q_proj.weight"].t()).view(B, T, heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = (h @ hf[f"{p}.self_attn.k_proj.weight"].t()).view(B, T, kv_heads, hd).transpose(1, 2)
        v = (h @ hf[f"{p}.self_attn.v_proj.weight"].t()).view(B, T, kv_heads, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = heads // kv_heads
        k = k[:, :, None].expand(B, kv_heads, group, T, hd).reshape(B, heads, T, hd)
        v = v[:, :, None].expand(B, kv_heads, group, T, hd).reshape(B, heads, T, hd)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # (B, H, T, hd)
        x = x + y.transpose(1, 2).reshape(B, T, heads * hd) @ hf[f"{p}.self_attn.o_proj.weight"].t()
        h = rms_norm(x, f"{p}.post_attention_layernorm.weight")
        gate, up = h @ hf[f"{p}.mlp.gate_proj.weight"].t(), h @ hf[f"{p}.mlp.up_proj.weight"].t()
        x = x + (torch.nn.functional.silu(gate) * up) @ hf[f"{p}.mlp.down_proj.weight"].t()
    head = hf["model.embed_tokens.weight"] if config["tie_word_embeddings"] else hf["lm_head.weight"]
    return rms_norm(x, "model.norm.weight") @ head.t()


# A RoPE scaling whose original context (16) is shorter than the sequence, so that it changes the logits.
SHORT_CONTEXT_ROPE = dict(rope_theta=10000.0, rope_factor=8.0, rope_original_context=16)
# Variants of the debug size (tied, 4 heads over 2 key/value heads, Llama 3.1 scaling: tests/models/test_hf_fixtures.py
# checks that combination against transformers itself).
CASES = {
    "untied": dict(tie_embeddings=False),
    "short-context-scaling": SHORT_CONTEXT_ROPE,
    "plain-rope": dict(rope_factor=None, rope_theta=10000.0),
    "head-dim-not-d-over-h": dict(head_dim=24, n_kv_heads=1),  # Qwen3-like: 4 x 24 query features from 64
}


def _case(name: str):
    return dataclasses.replace(named_config("llama3-debug", n_layers=2, seq_len=48), **CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_the_hf_llama_forward_on_our_exported_tensors_gives_our_logits(name):
    cfg = _case(name)
    model = build_model(cfg, seed=5)
    hf = HF.to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    config = HF.config_to_hf(cfg)
    assert ("lm_head.weight" in hf) is not cfg.tie_embeddings
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.n_kv_heads * cfg.head_dim, cfg.d_model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), llama_forward(hf, config, tokens), rtol=1e-5, atol=1e-5)


def test_the_reference_tells_rope_variants_apart():
    # The cases above would pass with a RoPE that ignores its scaling if the scaling did not change the logits.
    cfg = _case("short-context-scaling")
    model = build_model(cfg, seed=5)
    hf = HF.to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    plain = HF.config_to_hf(dataclasses.replace(cfg, rope_factor=None))
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.allclose(model(tokens), llama_forward(hf, plain, tokens), atol=1e-3)


def test_inverse_frequencies_follow_llama3_scaling_in_all_three_bands():
    for cfg in (DEBUG, named_config("llama3-8b"), named_config("llama3-1b")):
        config = HF.config_to_hf(cfg)
        want = reference_inv_freq(config)
        q = torch.zeros(1, 1, 1, cfg.head_dim)
        rope = Rope(theta=cfg.rope_theta, factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor, original_context=cfg.rope_original_context)
        got = inverse_frequencies(q, rope)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        unscaled = reference_inv_freq({**config, "rope_scaling": None})
        ratio = unscaled / got
        kept, divided = ratio < 1 + 1e-6, (ratio - cfg.rope_factor).abs() < 1e-4 * cfg.rope_factor
        assert kept.any() and divided.any() and (~kept & ~divided).any(), cfg  # every band occurs


def _config_5x(cfg) -> dict:
    """config.json as transformers 5.x writes it, from its documentation: one ``rope_parameters`` dict."""
    config = HF.config_to_hf(cfg)
    rope = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    scaling = config.pop("rope_scaling")
    if scaling:
        rope.update(scaling)
    return {**config, "rope_parameters": rope}


@pytest.mark.parametrize("size", ["llama3-debug", "llama3-1b", "llama3-8b", "llama3-405b"])
def test_both_config_json_generations_read_to_the_same_config(size):
    cfg = named_config(size)
    config_4x = HF.config_to_hf(cfg)
    assert config_4x["rope_scaling"]["rope_type"] == "llama3" and config_4x["rope_theta"] == 500000.0
    older = {**config_4x, "rope_scaling": {("type" if k == "rope_type" else k): v
                                           for k, v in config_4x["rope_scaling"].items()}}
    for config in (config_4x, _config_5x(cfg), older):
        assert HF.config_from_hf(config) == cfg
    plain = dataclasses.replace(cfg, rope_factor=None)
    assert HF.config_from_hf(_config_5x(plain)) == plain
    assert HF.config_from_hf({**config_4x, "rope_scaling": None}) == plain
    assert HF.config_from_hf({**config_4x, "rope_scaling": {"rope_type": "default"}}) == plain


def test_a_config_json_sets_the_training_length_to_at_most_8192():
    config = HF.config_to_hf(named_config("llama3-8b"))
    assert config["max_position_embeddings"] == 131072 and HF.config_from_hf(config).seq_len == 8192
    short = HF.config_from_hf({**config, "max_position_embeddings": 2048})
    assert short.seq_len == 2048 and short.max_position_embeddings == 2048


@pytest.mark.parametrize(("change", "key"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_configs_this_model_would_compute_differently_are_refused_naming_the_key(change, key):
    config = {**HF.config_to_hf(DEBUG), **change}
    config = {k: v for k, v in config.items() if v is not None or k == "rope_scaling"}
    with pytest.raises(ValueError, match=key):
        HF.config_from_hf(config)


def test_rms_norm_of_bf16_input_is_computed_in_fp32_and_cast_back_before_the_weight():
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = (torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0)) * 30).to(torch.bfloat16)
    x32 = x.to(torch.float32)
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = norm(x)
    assert got.dtype == want.dtype == torch.float32  # fp32 weight times the bf16 normalised input, as HF
    unit = RMSNorm(64, 1e-5)(x)  # weight ones: the normalised input as cast back, before any weight
    assert unit.to(torch.bfloat16).float().equal(unit)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # F.rms_norm rounds as Hugging Face does


# ---- shapes: Meta's widths and parameter counts, overrides, FLOPs ----

PUBLISHED = {  # (SwiGLU width, parameters): Meta's model cards / params.json (Llama 3.1 and 3.2)
    "llama3-1b": (8192, 1_235_814_400), "llama3-3b": (8192, 3_212_749_824), "llama3-8b": (14336, 8_030_261_248),
    "llama3-70b": (28672, 70_553_706_496), "llama3-405b": (53248, 405_853_388_800),
}


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_meta_sizes_have_the_published_widths_and_parameter_counts(size):
    cfg = named_config(size)
    width, params = PUBLISHED[size]
    assert cfg.mlp_width == width
    assert parameter_count(cfg) == params
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.norm_eps, cfg.rope_theta) == (128256, 8, 1e-5, 500000.0)
    assert cfg.tie_embeddings is (size in ("llama3-1b", "llama3-3b"))


def test_overrides_recompute_the_width_by_the_sizes_rule_and_the_head_dim():
    base = named_config("llama3-8b")
    wider = named_config("llama3-8b", d_model=2048, n_heads=16)
    # int(2 * 4 * 2048 / 3) = 5461 -> int(1.3 * 5461) = 7099 -> a multiple of 1024: 7168
    assert wider.mlp_width == ffn_width(2048, ffn_dim_multiplier=1.3, multiple_of=1024) == 7168
    assert wider.head_dim == 128 and wider.n_kv_heads == 8
    assert named_config("llama3-8b", d_model=2048, mlp_width=5000).mlp_width == 5000
    assert named_config("llama3-8b", n_heads=64).head_dim == 64
    assert named_config("llama3-8b", n_layers=2, n_kv_heads=4) == dataclasses.replace(base, n_layers=2, n_kv_heads=4)
    # A head_dim of its own (a Hugging Face config's) survives overrides that keep d_model and the heads.
    own = dataclasses.replace(base, head_dim=96)
    assert SPEC.with_overrides(own, n_layers=4, d_model=4096).head_dim == 96
    assert named_config("llama3-debug", seq_len=256).max_position_embeddings == 256


def test_flops_per_token_counts_every_matrix_product_once():
    for size in ("llama3-debug", "llama3-1b", "llama3-8b"):
        cfg = named_config(size)
        with torch.device("meta"):
            model = SPEC.build(cfg, share_tied_weights=False)
        # Every parameter but the embedding lookup; the head is a product even when it shares its weight.
        n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_emb.weight")
        attention = 12 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
        assert flops_per_token(cfg) == 6 * n + attention


# ---- the engine's constraints: document masking, tracing on meta, tensor-parallel checks ----

def test_a_document_packed_after_another_gets_the_logits_it_has_alone():
    cfg = named_config("llama3-debug", seq_len=32)
    model = build_model(cfg, seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
    first = 11
    positions = torch.cat((torch.arange(first), torch.arange(32 - first)))[None]  # two documents
    with torch.no_grad():
        packed = model(tokens, positions, document_ids(positions))
        alone = model(tokens[:, first:])
        torch.testing.assert_close(packed[:, first:], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, :first], model(tokens[:, :first]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(tokens)[:, first:], alone, atol=1e-3)  # without documents: one document
        assert not torch.allclose(model(tokens, positions)[:, first:], alone, atol=1e-3)
        torch.testing.assert_close(model(tokens, torch.arange(32)[None]), model(tokens), rtol=1e-5, atol=1e-6)


def test_the_meta_built_model_traces_into_stages_that_compute_the_eager_model():
    cfg = dataclasses.replace(named_config("llama3-debug", n_layers=2, seq_len=32), tie_embeddings=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.device("meta"):
        model = SPEC.build(cfg, share_tied_weights=False)
        example = torch.zeros(2, cfg.seq_len, dtype=torch.long)  # on meta too, as the engine traces (stages.py)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=[1, 1])
    stages = [pipe.get_stage_module(i) for i in range(2)]
    for stage in stages:
        restore_linear_modules(stage, model)
        stage.to_empty(device="cpu")
        init_weights(stage, seed=9, cfg=cfg)
    reference = build_model(cfg, seed=9)
    got, want = stages[1](stages[0](tokens)), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    (got.sum()).backward()
    want.sum().backward()
    grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast at run time, as the engine
        torch.testing.assert_close(stages[1](stages[0](tokens)), reference(tokens), rtol=0, atol=0)
    # Head counts stay -1 in the graph: a tensor-parallel shard with fewer heads runs the same graph.
    graph = str(stages[0].get_submodule("layers.0.attn").graph)
    assert f"[2, {cfg.seq_len}, -1, {cfg.head_dim}]" in graph
    assert f"[2, {cfg.seq_len}, {cfg.n_heads}, {cfg.head_dim}]" not in graph
    assert "device" not in graph  # nothing created on the trace's meta device


@pytest.mark.parametrize(("flags", "words"), [
    (["--mp", "4"], ["--mp 4", "key/value head count (--kv-heads 2)", "valid --mp values: 1, 2"]),
    (["--mp", "4", "--kv-heads", "4"], None),  # 4 heads over 4 key/value heads split 4 ways
    (["--kv-heads", "3"], ["--kv-heads 3", "--heads 4", "valid --kv-heads values: 1, 2, 4"]),
    (["--mp", "2", "--heads", "8", "--kv-heads", "2", "--mlp-width", "101"], ["--mp 2", "--mlp-width 101"]),
])
def test_tensor_parallel_checks_name_the_flag_before_any_process_group(flags, words):
    nproc = int(flags[flags.index("--mp") + 1]) if "--mp" in flags else 1
    argv = ["--model", "llama3-debug", "--steps", "1", *flags]
    env = LaunchEnv(rank=0, world_size=nproc, local_rank=0, local_world_size=nproc)
    if words is None:
        check_inputs(argv, env)
        return
    with pytest.raises(InputError) as raised:
        check_inputs(argv, env)
    line = str(raised.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_named_sizes_run_on_eight_way_tensor_parallelism():
    for size in PUBLISHED:
        assert SPEC.check(named_config(size), 8) is None
        assert SPEC.check(named_config(size), 16) == ShapeProblem(MP, 16, "divide", "n_kv_heads", 8, valid=(1, 2, 4, 8))
