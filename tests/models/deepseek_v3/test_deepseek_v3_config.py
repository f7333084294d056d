"""The DeepSeek-V3 family's sizes (models/deepseek_v3/config.py): the published configs, and --kv-heads refused by
multi-head latent attention. (Every family's published counts, FLOPs, flag checks and trace: tests/models/test_family_*.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from models import named_config


def test_the_published_sizes_are_their_configs():
    v3, lite = named_config("deepseek-v3"), named_config("deepseek-v3-16b")
    assert (v3.n_layers, v3.d_model, v3.n_heads, v3.q_lora_rank, v3.kv_lora_rank, v3.n_experts, v3.top_k,
            v3.n_group, v3.topk_group, v3.n_shared_experts, v3.first_k_dense, v3.routed_scaling_factor) == (
        61, 7168, 128, 1536, 512, 256, 8, 8, 4, 1, 3, 2.5)
    assert (v3.rope_yarn.factor, v3.rope_yarn.original_context) == (40.0, 4096)
    assert v3.softmax_factor() == pytest.approx(1.874, abs=1e-3)
    assert (lite.n_layers, lite.d_model, lite.n_heads, lite.q_lora_rank, lite.n_experts, lite.top_k,
            lite.n_shared_experts, lite.expert_width, lite.mlp_width, lite.vocab_size) == (
        27, 2048, 16, 0, 64, 6, 2, 1408, 10944, 102400)


def test_kv_heads_is_refused_and_the_latent_sizes_stay():
    with pytest.raises(ValueError, match="--kv-heads 2: multi-head latent attention"):
        named_config("deepseek-v3-debug", n_kv_heads=2)
    cfg = named_config("deepseek-v3-debug", d_model=96, n_heads=6, seq_len=128)
    assert cfg.latent() == dataclasses.replace(named_config("deepseek-v3-debug").latent(), n_heads=6)
    assert cfg.n_kv_heads == 6 and cfg.context == 128
