"""The planner's closed-form shape costs against what torch counts: compiler/cost.py on the engine's GPT,
and FlopCounterMode / autograd's saved tensors on a hand-written GQA + SwiGLU + RMSNorm + RoPE block."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import models
from compiler.cost import _profile, layer_costs
from compiler.flops import training_flops_per_token
from compiler.planner.activations import analytic_layer_costs
from compiler.planner.shape import (
    DENSE,
    MOE,
    DecoderShape,
    activated_parameter_count,
    block_params,
    hardware_flops_per_token,
    megatron_model_flops_per_token,
    model_flops_per_token,
    parameter_count,
)
from models import named_config, spec_of
from models.spec import Experts
from tests.paths import ROOT

TABLE1 = ROOT / "compiler" / "published" / "megatron_sc21_table1.json"

GPT_SHAPES = [named_config("tiny", n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=256, mlp_width=256),
              named_config("tiny", n_layers=2, d_model=96, n_heads=6, seq_len=48, vocab_size=500, mlp_width=384,
                           tie_embeddings=False),
              named_config("small"),
              # Llama's GQA, SwiGLU, RMSNorm and RoPE, counted on the engine's model too.
              named_config("llama3-debug", seq_len=32), named_config("llama3-debug", n_heads=8, n_kv_heads=4, seq_len=32)]


@pytest.mark.parametrize("cfg", GPT_SHAPES, ids=lambda c: f"d{c.d_model}")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mp", [1, 2])
def test_analytic_costs_equal_the_engines_counted_costs(cfg, precision, mp):
    counted = layer_costs(cfg, micro_batch_size=3, precision=precision, mp=mp)
    analytic = analytic_layer_costs(DecoderShape.from_config(cfg), micro_batch_size=3, precision=precision, mp=mp)
    assert [c.name for c in analytic] == [c.name for c in counted]
    for a, c in zip(analytic, counted):
        assert a.flops == c.flops and a.params == c.params, a.name
        assert a.activation_bytes == pytest.approx(c.activation_bytes, rel=1e-3), a.name
        assert a.selective_activation_bytes == pytest.approx(c.selective_activation_bytes, rel=1e-3), a.name
        assert a.selective_recompute_bytes == pytest.approx(c.selective_recompute_bytes, rel=1e-3), a.name
        assert a.transient_bytes == c.transient_bytes, a.name
        # Autocast's weight copies: every matrix and bias (counted: one d-sized bias or the norm's less or more).
        assert a.weight_copy_bytes == pytest.approx(c.weight_copy_bytes, rel=0.04), a.name


def test_parameter_and_model_flop_counts_match_the_engine():
    for cfg in GPT_SHAPES:
        shape = DecoderShape.from_config(cfg)
        assert parameter_count(shape) == sum(p.numel() for p in spec_of(cfg).build(cfg).parameters())
        assert model_flops_per_token(shape) == training_flops_per_token(cfg)


def test_hardware_flops_are_megatrons_table1_formula():
    """96 B s l h^2 (1 + s/6h + V/16lh) per B s tokens, up to biases and norms (< 0.1%)."""
    data = json.loads(TABLE1.read_text())
    s, vocab = data["setup"]["seq_len"], data["setup"]["vocab"]
    for row in data["rows"]:
        _, heads, h, layers, *_ = row
        shape = DecoderShape.from_flags(layers=layers, d_model=h, heads=heads, seq_len=s, vocab_size=vocab)
        paper = 96 * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h)) / s
        assert hardware_flops_per_token(shape, activation_checkpointing=True) == pytest.approx(paper, rel=1e-3)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, torch's fused rms_norm (the engine's Llama norm, as Hugging Face's)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=1e-5)


class LlamaBlock(nn.Module):
    """GQA attention with separate q, k, v projections, rotate-half RoPE and the grouped k / v heads shared by
    attention (enable_gqa, no copies), SwiGLU, RMSNorm, no biases: the layout shape.py prices (written here
    independently of it)."""

    def __init__(self, d: int, heads: int, kv_heads: int, width: int, seq: int):
        super().__init__()
        self.hd, self.group = d // heads, heads // kv_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, heads * self.hd, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, d, bias=False)
        self.gate, self.up = nn.Linear(d, width, bias=False), nn.Linear(d, width, bias=False)
        self.down = nn.Linear(width, d, bias=False)
        self.seq = seq

    def cos_sin(self, x):  # (1, T, 1, hd) each, in x's dtype, once per block for q and k
        half = self.hd // 2
        rates = 1e4 ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(self.seq, dtype=torch.float32), rates).repeat(1, 2)[None, :, None]
        return angles.cos().type_as(x), angles.sin().type_as(x)

    def rope(self, x, cos, sin):  # x: (B, T, heads, hd)
        half = self.hd // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, T, -1, self.hd)
        cos, sin = self.cos_sin(q)
        q = self.rope(q, cos, sin)
        k = self.rope(self.k(h).view(B, T, -1, self.hd), cos, sin)
        v = self.v(h).view(B, T, -1, self.hd)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                           enable_gqa=True)  # (B, H, T, hd)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_gqa_swiglu_formulas_against_a_counted_block(precision, kv_heads):
    shape = DecoderShape.from_flags(layers=1, d_model=64, heads=8, kv_heads=kv_heads, mlp_width=160, mlp="swiglu",
                                    seq_len=32, vocab_size=256)
    b = 2
    with FakeTensorMode():
        block = LlamaBlock(64, 8, kv_heads, 160, 32)
        x = torch.randn(b, 32, 64, requires_grad=True)
        counted = _profile("block", lambda: block(x), [block], precision)
    analytic = analytic_layer_costs(shape, micro_batch_size=b, precision=precision)[1]
    assert counted.params == analytic.params == block_params(shape).total
    # GQA's attention FLOPs are the query heads'; torch counts SDPA on the repeated k and v the same way.
    assert analytic.flops == pytest.approx(counted.flops, rel=1e-9)
    assert analytic.activation_bytes == pytest.approx(counted.activation_bytes, rel=1e-3)


def test_shapes_from_every_family_config():
    gpt = DecoderShape.from_config(named_config("small"))
    assert (gpt.mlp, gpt.norm, gpt.biases, gpt.kv_heads, gpt.tied) == ("gelu", "layernorm", True, 12, True)
    shape = DecoderShape.from_config(named_config("llama3-8b"))
    assert (shape.mlp, shape.norm, shape.biases, shape.kv_heads, shape.head_dim) == ("swiglu", "rmsnorm", False, 8, 128)
    # Meta's Llama 3.1 8B: 8,030,261,248 parameters, as the engine's model counts them on the meta device.
    assert parameter_count(shape) == models.parameter_count(named_config("llama3-8b")) == 8_030_261_248
    # Qwen3 and the mixtures' shapes come from their specs too: total and activated parameters as the engine counts them
    # (Qwen3-30B-A3B: 30,532,122,624 total, published "30.5B in total and 3.3B activated").
    for name in ("qwen3-debug", "qwen3-8b", "qwen3-moe-debug", "qwen3-30b-a3b", "mixtral-debug", "mixtral-8x7b"):
        cfg = named_config(name)
        shape = DecoderShape.from_config(cfg)
        assert parameter_count(shape) == models.parameter_count(cfg), name  # Qwen3's q/k norms included
        if hasattr(cfg, "n_experts"):
            assert shape.experts is not None and shape.experts.count == cfg.n_experts, name
            assert activated_parameter_count(shape) < parameter_count(shape), name
    assert parameter_count(DecoderShape.from_config(named_config("qwen3-30b-a3b"))) == 30_532_122_624
    assert DecoderShape.from_flags(layers=126, d_model=16384, heads=128, kv_heads=8, mlp_width=53248, mlp="swiglu",
                                   seq_len=8192, vocab_size=128256).shard_error(16) == "--mp 16 must divide --kv-heads 8"


def test_a_mixture_of_experts_counts_total_and_activated_parameters_by_hand():
    """Qwen3-30B-A3B's published shape (48 layers, d 2048, 32 heads of 128, 4 kv, 128 experts of 768, top 8,
    vocabulary 151,936, untied, QK-norm): 30.5B parameters (keras-hub's preset lists 30,532,122,624), 3.3B
    activated (its model card), by hand here."""
    shape = DecoderShape.from_flags(layers=48, d_model=2048, heads=32, kv_heads=4, head_dim=128, mlp="swiglu",
                                    mlp_width=6144, seq_len=4096, vocab_size=151936, tied=False, qk_norm=True,
                                    experts=Experts(128, 8, 768))
    d, q, kv, e, w = 2048, 32 * 128, 4 * 128, 128, 768
    attention = d * q + 2 * d * kv + q * d
    norms = 2 * d + 2 * 128
    expert = 3 * d * w
    block = attention + norms + d * e + e * expert
    assert block_params(shape, kind=MOE).total == block
    total = 48 * block + 2 * 151936 * d + d
    assert parameter_count(shape) == total
    assert total == 30_532_122_624
    active = total - 48 * (e - 8) * expert
    assert activated_parameter_count(shape) == active and 3.3e9 <= active < 3.4e9
    # Expert parallelism holds count / ep experts; the rest of the block stays whole.
    assert block_params(shape, kind=MOE, ep=8).experts == 16 * expert
    # MFU counts the activated matrices (routed top-k), PaLM's attention term; Megatron's today halves it.
    matmul = 48 * (attention + norms + d * e + 8 * expert) + 151936 * d + d
    assert model_flops_per_token(shape) == 6 * matmul + 12 * 48 * 4096 * q
    assert megatron_model_flops_per_token(shape) == pytest.approx(
        6 * (48 * (attention + norms + d * e + 8 * expert) + 151936 * d) + 6 * 48 * 4096 * q)


def test_first_k_dense_layers_keep_the_dense_mlp():
    shape = DecoderShape.from_flags(layers=6, d_model=256, heads=4, mlp="swiglu", mlp_width=1024, seq_len=64,
                                    vocab_size=1000, experts=Experts(8, 2, 128, shared=1, dense_layers=(0, 1)))
    assert shape.kinds() == [DENSE, DENSE, MOE, MOE, MOE, MOE]
    dense, moe = block_params(shape, kind=DENSE), block_params(shape, kind=MOE)
    attention = 4 * 256 * 256
    assert dense.total == attention + 3 * 256 * 1024 + 2 * 256
    assert moe.dense == attention + 2 * 256 + 256 * 8 + 3 * 256 * 128  # router and the shared expert
    assert moe.experts == 8 * 3 * 256 * 128
    assert parameter_count(shape) == 2 * dense.total + 4 * moe.total + 2 * 1000 * 256 + 256


MOE_SHAPES = [named_config("qwen3-moe-debug"), named_config("mixtral-debug"), named_config("qwen3-debug", seq_len=32),
              # v's head dim equal to q's and k's: the CPU's flash kernel (a narrower v takes the math path, which
              # keeps (T, T) probabilities no GPU kernel keeps)
              dataclasses.replace(named_config("deepseek-v3-16b-debug"), v_head_dim=16),
              dataclasses.replace(named_config("deepseek-v3-debug"), v_head_dim=16)]


@pytest.mark.parametrize("cfg", MOE_SHAPES, ids=lambda c: c.family)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mp", [1, 2])
def test_mixture_qk_norm_and_latent_blocks_save_what_the_engine_counts(cfg, precision, mp):
    """Every block kind's saved bytes (MoE: the router's fp32 copies, the routed copies and their bookkeeping, the
    shared MLP; Qwen3's q/k norms; latent attention) against compiler/cost.py's count. Without SP every TP rank
    routes all the tokens (compiler/parallelize/expert_parallel.py), as counted here."""
    counted = layer_costs(cfg, micro_batch_size=2, precision=precision, mp=mp)
    analytic = analytic_layer_costs(DecoderShape.from_config(cfg), micro_batch_size=2, precision=precision, mp=mp)
    for a, c in zip(analytic[1:-1], counted[1:-1]):
        assert a.activation_bytes == pytest.approx(c.activation_bytes, rel=1e-2), a.name
