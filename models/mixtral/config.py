"""The Mixtral family's shapes (Jiang et al. 2024, "Mixtral of Experts", table 1; the hub's config.json of
Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1): Llama's attention (head_dim d_model / n_heads, 8 key/value heads,
plain RoPE with base 1,000,000, RMSNorm eps 1e-5) and in every block 8 SwiGLU experts of which each token uses 2
(softmax over the 8 gate logits, the two weights renormalised), no shared experts; vocabulary 32,000, untied,
no sliding window. ``router_aux_loss_coef`` 0.02 as the published configs set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common import shapes
from models.common.router import Routing
from models.spec import MOE, Experts, ShapeProblem

TRAINING_SEQ_LEN = 4096


@dataclass(frozen=True)
class MixtralConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int
    vocab_size: int
    mlp_width: int  # each expert's SwiGLU width (intermediate_size)
    n_experts: int = 8  # num_local_experts
    top_k: int = 2  # num_experts_per_tok
    router_aux_loss_coef: float = 0.02
    tie_embeddings: bool = False
    expert_bias: bool = False  # a selection-only bias, moved by the engine's --expert-bias-rate (DeepSeek-V3)
    router_init_std: float = 0.02  # the router's initial weights; the debug size's are wide apart (well-separated scores)
    norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="mixtral", init=False)

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings

    def routing(self) -> Routing:
        return Routing(top_k=self.top_k, norm_topk_prob=True, expert_bias=self.expert_bias)  # Mixtral always renormalises


def _published(*, n_layers: int, d_model: int, n_heads: int, mlp_width: int, context: int) -> MixtralConfig:
    return MixtralConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=8, head_dim=d_model // n_heads,
                         seq_len=TRAINING_SEQ_LEN, vocab_size=32000, mlp_width=mlp_width,
                         max_position_embeddings=context)


MODEL_SIZES: dict[str, MixtralConfig] = {
    # For tests: 8 experts of width 64 (2 per token), 4 heads of 16 over 2 key/value heads, bytes as the vocabulary.
    "mixtral-debug": MixtralConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, seq_len=64,
                                   vocab_size=256, mlp_width=64, max_position_embeddings=64, router_init_std=0.5),
    "mixtral-8x7b": _published(n_layers=32, d_model=4096, n_heads=32, mlp_width=14336, context=32768),
    "mixtral-8x22b": _published(n_layers=56, d_model=6144, n_heads=48, mlp_width=16384, context=65536),
}


def check(cfg: MixtralConfig, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None: attention as Llama's (head_dim derived);
    the experts are not tensor-parallel."""
    derived = cfg.n_heads > 0 and cfg.head_dim == cfg.d_model // cfg.n_heads
    return Routing(top_k=cfg.top_k).check(cfg.n_experts) or shapes.check_attention(
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mp=mp,
        head_dim_derived=derived)


def matmul_params(cfg: MixtralConfig, *, activated: bool) -> int:
    """Parameters in a token's matrix products (``activated``: 2 of the 8 experts) or in all of them."""
    attention = shapes.attention_params(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                        head_dim=cfg.head_dim)
    experts = cfg.top_k if activated else cfg.n_experts
    moe = cfg.d_model * cfg.n_experts + experts * 3 * cfg.d_model * cfg.mlp_width  # router, experts
    return cfg.n_layers * (attention + moe) + cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: MixtralConfig) -> float:
    """6 N_activated + attention (models/common/shapes.py)."""
    return shapes.flops_per_token(matmul_params=matmul_params(cfg, activated=True), n_layers=cfg.n_layers,
                                  seq_len=cfg.seq_len, n_heads=cfg.n_heads, head_dim=cfg.head_dim)


def with_overrides(base: MixtralConfig, **given) -> MixtralConfig:
    """The flags' overrides; a new d_model or head count makes head_dim d_model / n_heads (models/common/shapes.py)."""
    return shapes.with_overrides(base, derive_head_dim=True, **given)


def block_kinds(cfg: MixtralConfig) -> tuple[str, ...]:
    return (MOE,) * cfg.n_layers


def experts(cfg: MixtralConfig) -> Experts:
    """The mixture as the planner prices it: every block's E experts of ``mlp_width``, k per token."""
    return Experts(cfg.n_experts, cfg.top_k, cfg.mlp_width)
