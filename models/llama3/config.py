"""The Llama 3 family's shapes: its config, Meta's sizes, the SwiGLU width rule, flag overrides, the checks
that say why a shape cannot run, and its FLOPs per token.

Sizes (Meta's ``params.json`` of each release; Llama 3 Herd of Models, Dubey et al. 2024, table 3): 8B,
70B and 405B are Llama 3.1, 1B and 3B Llama 3.2 (which tie their embeddings). All have a vocabulary of
128,256, RMSNorm eps 1e-5, no biases, grouped-query attention with 8 key/value heads, and RoPE with base
500,000 and Llama 3's frequency scaling (original context 8192, low / high frequency factors 1 / 4; the
scaling factor is 8 in Llama 3.1 and 32 in Llama 3.2, as each release's ``config.json`` says). The
published context is 131,072 tokens; the engine trains on ``seq_len`` tokens (8192 for the named sizes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.common import shapes
from models.common.shapes import attention_params, check_attention, check_width
from models.spec import ShapeProblem

# Meta's defaults (llama/model.py ModelArgs): the width rule rounds to multiples of 256 unless told otherwise.
DEFAULT_MULTIPLE_OF = 256


def ffn_width(d_model: int, *, ffn_dim_multiplier: float | None, multiple_of: int) -> int:
    """SwiGLU hidden width, Meta's rule (llama/model.py FeedForward): 2/3 of 4 * d_model (SwiGLU's three
    matrices cost what a 4x two-matrix MLP does; Shazeer 2020), times ``ffn_dim_multiplier``, rounded up to
    a multiple of ``multiple_of``. 8B: int(2 * 16384 / 3) = 10922 -> int(1.3 * 10922) = 14198 -> 14336."""
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    d_model: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention: n_heads // n_kv_heads query heads share one)
    seq_len: int  # the training sequence length: what the engine traces
    vocab_size: int
    mlp_width: int  # SwiGLU hidden units (ffn_width of d_model for Meta's sizes)
    head_dim: int  # d_model // n_heads for Llama; Hugging Face configs may set another (Qwen3)
    tie_embeddings: bool = False  # the LM head reuses the token embedding (Llama 3.2 1B and 3B)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3's RoPE frequency scaling (rope.py); rope_factor None is plain RoPE and the other three unused.
    rope_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192  # "original_max_position_embeddings"
    max_position_embeddings: int = 8192  # the model's context (config.json's), never changed by the window
    # The width rule's inputs, so that an override of d_model recomputes the width the size's way.
    ffn_dim_multiplier: float | None = None
    multiple_of: int = DEFAULT_MULTIPLE_OF
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="llama3", init=False)

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings


_META = dict(vocab_size=128256, seq_len=8192, rope_theta=500000.0, rope_low_freq_factor=1.0,
             rope_high_freq_factor=4.0, rope_original_context=8192, max_position_embeddings=131072, n_kv_heads=8)


def meta_size(*, n_layers: int, d_model: int, n_heads: int, ffn_dim_multiplier: float, multiple_of: int,
              rope_factor: float, tie_embeddings: bool) -> LlamaConfig:
    return LlamaConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, head_dim=d_model // n_heads,
                       mlp_width=ffn_width(d_model, ffn_dim_multiplier=ffn_dim_multiplier, multiple_of=multiple_of),
                       ffn_dim_multiplier=ffn_dim_multiplier, multiple_of=multiple_of, rope_factor=rope_factor,
                       tie_embeddings=tie_embeddings, **_META)


MODEL_SIZES: dict[str, LlamaConfig] = {
    # For tests: 64 wide, 4 heads of 16 (2 key/value heads: GQA groups of 2), bytes as the vocabulary. It keeps
    # the named sizes' scaled RoPE: with head_dim 16 and base 500,000 its 8 frequencies have wavelengths from
    # 6 to 600,000 tokens, so the llama3 rule's three bands (kept, smoothed, divided by 8) all occur, and every
    # parity test runs the code path of the real sizes.
    "llama3-debug": LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, seq_len=64,
                                vocab_size=256, mlp_width=ffn_width(64, ffn_dim_multiplier=None, multiple_of=32),
                                multiple_of=32, tie_embeddings=True, rope_factor=8.0, max_position_embeddings=64),
    "llama3-1b": meta_size(n_layers=16, d_model=2048, n_heads=32, ffn_dim_multiplier=1.5, multiple_of=1024,
                           rope_factor=32.0, tie_embeddings=True),
    "llama3-3b": meta_size(n_layers=28, d_model=3072, n_heads=24, ffn_dim_multiplier=1.0, multiple_of=1024,
                           rope_factor=32.0, tie_embeddings=True),
    "llama3-8b": meta_size(n_layers=32, d_model=4096, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024,
                           rope_factor=8.0, tie_embeddings=False),
    "llama3-70b": meta_size(n_layers=80, d_model=8192, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096,
                            rope_factor=8.0, tie_embeddings=False),
    "llama3-405b": meta_size(n_layers=126, d_model=16384, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096,
                             rope_factor=8.0, tie_embeddings=False),
}


def with_overrides(base: LlamaConfig, *, n_layers: int | None = None, d_model: int | None = None,
                   n_heads: int | None = None, n_kv_heads: int | None = None, seq_len: int | None = None,
                   vocab_size: int | None = None, mlp_width: int | None = None,
                   tie_embeddings: bool | None = None) -> LlamaConfig:
    """A named size with the flags' overrides. A new d_model recomputes the SwiGLU width by the size's rule
    (unless --mlp-width is given); a new d_model or head count makes head_dim d_model / n_heads (kept when
    neither changes, so a Hugging Face config's own head_dim survives other overrides). For a model built from
    scratch, the context grows to a longer training sequence, never shrinks (RoPE has no table to size); an
    existing model's window changes with ``models.with_window``, which keeps its context."""
    d = base.d_model if d_model is None else d_model
    heads = base.n_heads if n_heads is None else n_heads
    reshaped = d != base.d_model or heads != base.n_heads
    if mlp_width is None:
        mlp_width = (base.mlp_width if d == base.d_model else
                     ffn_width(d, ffn_dim_multiplier=base.ffn_dim_multiplier, multiple_of=base.multiple_of))
    seq = base.seq_len if seq_len is None else seq_len
    return dataclasses.replace(
        base, n_layers=base.n_layers if n_layers is None else n_layers, d_model=d, n_heads=heads,
        n_kv_heads=base.n_kv_heads if n_kv_heads is None else n_kv_heads, seq_len=seq,
        vocab_size=base.vocab_size if vocab_size is None else vocab_size, mlp_width=mlp_width,
        head_dim=d // heads if reshaped and heads else base.head_dim,
        tie_embeddings=base.tie_embeddings if tie_embeddings is None else tie_embeddings,
        max_position_embeddings=max(base.max_position_embeddings, seq))


def check(cfg: LlamaConfig, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None: the attention's
    head counts and the MLP width must divide by mp (models/common/shapes.py). d_model itself is never split (q, k,
    v, gate and up split their outputs; o and down their inputs)."""
    derived = cfg.head_dim == cfg.d_model // cfg.n_heads if cfg.n_heads > 0 else True
    return (check_attention(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                            mp=mp, head_dim_derived=derived) or check_width(cfg.mlp_width, mp))


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in matrix products: the blocks (with their norms), the final norm and the
    head (a tied head too: it is a matrix product whatever it shares). Not the embedding lookup."""
    attention = attention_params(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                 head_dim=cfg.head_dim)
    return cfg.n_layers * (attention + 3 * cfg.d_model * cfg.mlp_width) + cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: LlamaConfig) -> float:
    """6N + attention (models/common/shapes.py), N the matrix-product parameters."""
    return shapes.flops_per_token(matmul_params=matmul_params(cfg), n_layers=cfg.n_layers, seq_len=cfg.seq_len,
                                  n_heads=cfg.n_heads, head_dim=cfg.head_dim)
