"""Llama 3's sizes (models/llama3/config.py) beyond what every family's published sizes are checked for
(tests/models/test_family_sizes.py): Meta's SwiGLU widths and shared settings, the width rule and head_dim under
overrides, and the key/value heads that stop tensor parallelism at 8 ranks."""

from __future__ import annotations

import dataclasses

import pytest

from models import named_config, spec_of
from models.llama3.config import ffn_width
from models.spec import MP, ShapeProblem

SPEC = spec_of(named_config("llama3-debug"))

MLP_WIDTHS = {  # SwiGLU widths: Meta's params.json (Llama 3.1 and 3.2)
    "llama3-1b": 8192, "llama3-3b": 8192, "llama3-8b": 14336, "llama3-70b": 28672, "llama3-405b": 53248,
}


@pytest.mark.parametrize("size", list(MLP_WIDTHS))
def test_meta_sizes_have_the_published_widths_and_shared_settings(size):
    cfg = named_config(size)
    assert cfg.mlp_width == MLP_WIDTHS[size]
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.norm_eps, cfg.rope_theta) == (128256, 8, 1e-5, 500000.0)
    assert cfg.tie_embeddings is (size in ("llama3-1b", "llama3-3b"))
    # Eight key/value heads: eight tensor-parallel ranks at most.
    assert SPEC.check(cfg, 16) == ShapeProblem(MP, 16, "divide", "n_kv_heads", 8, valid=(1, 2, 4, 8))


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
