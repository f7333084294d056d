"""Llama 3 against Hugging Face's LlamaForCausalLM: a forward written here from its math (itself checked against
transformers' own logits in tests/models/test_hf_fixtures.py, which also runs our model on a folder transformers wrote:
tied, grouped-query, Llama 3.1 scaling) gives our logits on the variants that folder does not have (untied, a short
original context, plain RoPE, a head_dim other than d/h); the llama3 RoPE scaling in all three bands; RMSNorm of bf16
input as HF rounds it; config.json as this family writes and reads it beyond the checks every family passes
(tests/models/test_family_hf_config.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models import build_model, named_config, spec_of
from models.common.norm import RMSNorm
from models.common.rope import Rope, inverse_frequencies

DEBUG = named_config("llama3-debug")
HF = spec_of(DEBUG).hf


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


@pytest.mark.parametrize("size", ["llama3-debug", "llama3-1b", "llama3-8b", "llama3-405b"])
def test_config_json_is_written_with_the_llama3_scaling_and_a_plain_rope_reads_from_every_spelling(size):
    """Both generations' spellings of every size: tests/models/test_family_hf_config.py. Here the RoPE the sizes
    write, and a Llama without scaling read from 5.x ``rope_parameters`` and from each 4.x way of saying none."""
    cfg = named_config(size)
    written = HF.config_to_hf(cfg)
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_theta"] == 500000.0
    plain = dataclasses.replace(cfg, rope_factor=None)
    plain_5x = {**{k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling")},
                "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    assert HF.config_from_hf(plain_5x) == plain
    assert HF.config_from_hf({**written, "rope_scaling": None}) == plain
    assert HF.config_from_hf({**written, "rope_scaling": {"rope_type": "default"}}) == plain


def test_a_config_json_sets_the_training_length_to_at_most_8192():
    config = HF.config_to_hf(named_config("llama3-8b"))
    assert config["max_position_embeddings"] == 131072 and HF.config_from_hf(config).seq_len == 8192
    short = HF.config_from_hf({**config, "max_position_embeddings": 2048})
    assert short.seq_len == 2048 and short.max_position_embeddings == 2048


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


