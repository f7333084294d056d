"""The Qwen3 dense family's shapes (Qwen3 Technical Report, Yang et al. 2025, table 1; each size's config.json
on the Hugging Face hub): its config, sizes, flag overrides, the checks that say why a shape cannot run, and
FLOPs per token.

All sizes: vocabulary 151,936, 128-wide heads whatever d_model (head_dim is a setting of its own: 0.6B has 16
heads of 128 on d_model 1024), 8 key/value heads, per-head RMSNorm on q and k, RMSNorm eps 1e-6, plain RoPE with
base 1,000,000, context 40,960 (``max_position_embeddings``); 0.6B, 1.7B and 4B tie their embeddings. The engine
trains on ``seq_len`` tokens: 4,096 for the named sizes, Qwen3's first two pre-training stages' length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common import shapes
from models.spec import ShapeProblem

QWEN3_VOCABULARY = 151936
TRAINING_SEQ_LEN = 4096


@dataclass(frozen=True)
class Qwen3Config:
    n_layers: int
    d_model: int
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int  # a setting of its own, not d_model / n_heads
    seq_len: int  # the training sequence length: what the engine traces
    vocab_size: int
    mlp_width: int  # SwiGLU hidden units (intermediate_size)
    tie_embeddings: bool = False
    norm_eps: float = 1e-6  # every RMSNorm, the q/k norms too
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960  # the model's context (config.json's), never changed by the window
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="qwen3", init=False)

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings


def _published(*, n_layers: int, d_model: int, n_heads: int, mlp_width: int, tie: bool) -> Qwen3Config:
    return Qwen3Config(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                       seq_len=TRAINING_SEQ_LEN, vocab_size=QWEN3_VOCABULARY, mlp_width=mlp_width, tie_embeddings=tie)


MODEL_SIZES: dict[str, Qwen3Config] = {
    # For tests: 4 heads of 24 on d_model 64 (q is 96 wide, not 64: head_dim is its own setting, as in Qwen3),
    # 2 key/value heads, bytes as the vocabulary, tied as the small sizes are.
    "qwen3-debug": Qwen3Config(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=24, seq_len=64, vocab_size=256,
                               mlp_width=128, tie_embeddings=True, max_position_embeddings=64),
    "qwen3-0.6b": _published(n_layers=28, d_model=1024, n_heads=16, mlp_width=3072, tie=True),
    "qwen3-1.7b": _published(n_layers=28, d_model=2048, n_heads=16, mlp_width=6144, tie=True),
    "qwen3-4b": _published(n_layers=36, d_model=2560, n_heads=32, mlp_width=9728, tie=True),
    "qwen3-8b": _published(n_layers=36, d_model=4096, n_heads=32, mlp_width=12288, tie=False),
    "qwen3-14b": _published(n_layers=40, d_model=5120, n_heads=40, mlp_width=17408, tie=False),
    "qwen3-32b": _published(n_layers=64, d_model=5120, n_heads=64, mlp_width=25600, tie=False),
}


def with_overrides(base: Qwen3Config, **given) -> Qwen3Config:
    """The flags' overrides; head_dim stays the size's (models/common/shapes.py)."""
    return shapes.with_overrides(base, derive_head_dim=False, **given)


def check(cfg: Qwen3Config, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None."""
    return (shapes.check_attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                   head_dim=cfg.head_dim, mp=mp, head_dim_derived=False)
            or shapes.check_width(cfg.mlp_width, mp))


def matmul_params(cfg: Qwen3Config) -> int:
    """Parameters in the matrix products (the blocks with their norms, the final norm, the head; not the
    embedding lookup)."""
    attention = shapes.attention_params(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                        head_dim=cfg.head_dim, qk_norm=True)
    return cfg.n_layers * (attention + 3 * cfg.d_model * cfg.mlp_width) + cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: Qwen3Config) -> float:
    return shapes.flops_per_token(matmul_params=matmul_params(cfg), n_layers=cfg.n_layers, seq_len=cfg.seq_len,
                                  n_heads=cfg.n_heads, head_dim=cfg.head_dim)
