"""The Qwen3-MoE family's shapes (Qwen3 Technical Report, Yang et al. 2025, table 2; the hub's config.json of
Qwen3-30B-A3B and Qwen3-235B-A22B): Qwen3's attention, and in every block a mixture of 128 experts of which each
token uses 8 (softmax router, the 8 weights renormalised), no shared experts; blocks listed in ``mlp_only_layers``
(or skipped by ``decoder_sparse_step``) keep a dense SwiGLU of ``mlp_width`` (``intermediate_size``; no published
size has one). The auxiliary load-balancing loss's coefficient is ``router_aux_loss_coef`` (0.001).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common import shapes
from models.common.moe import block_kinds as kinds_of_blocks
from models.common.router import Routing
from models.qwen3.config import QWEN3_VOCABULARY, TRAINING_SEQ_LEN
from models.spec import MOE, Experts, ShapeProblem


@dataclass(frozen=True)
class Qwen3MoeConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int
    vocab_size: int
    mlp_width: int  # the dense blocks' SwiGLU width (intermediate_size)
    n_experts: int  # num_experts (4.x) / num_local_experts (5.x)
    top_k: int  # num_experts_per_tok
    expert_width: int  # each expert's SwiGLU width (moe_intermediate_size)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    tie_embeddings: bool = False
    expert_bias: bool = False  # a selection-only bias, moved by the engine's --expert-bias-rate (DeepSeek-V3)
    router_init_std: float = 0.02  # the router's initial weights; the debug size's are wide apart (well-separated scores)
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="qwen3_moe", init=False)

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings

    def routing(self) -> Routing:
        return Routing(top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, expert_bias=self.expert_bias)


def block_kinds(cfg: Qwen3MoeConfig) -> tuple[str, ...]:
    return kinds_of_blocks(cfg.n_layers, sparse_step=cfg.decoder_sparse_step, dense_layers=cfg.mlp_only_layers)


def experts(cfg: Qwen3MoeConfig) -> Experts:
    """The mixture as the planner prices it: E experts of ``expert_width``, k per token, no shared expert;
    the blocks that are not sparse keep the dense SwiGLU of ``mlp_width``."""
    dense = tuple(i for i, kind in enumerate(block_kinds(cfg)) if kind != MOE)
    return Experts(cfg.n_experts, cfg.top_k, cfg.expert_width, dense_layers=dense)


def config_from_dict(d: dict) -> Qwen3MoeConfig:
    """A checkpoint manifest's dict (JSON turned the tuple into a list) -> the config."""
    return Qwen3MoeConfig(**{**d, "mlp_only_layers": tuple(d.get("mlp_only_layers", ()))})


def _published(*, n_layers: int, d_model: int, n_heads: int, expert_width: int, mlp_width: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=4, head_dim=128,
                          seq_len=TRAINING_SEQ_LEN, vocab_size=QWEN3_VOCABULARY, mlp_width=mlp_width, n_experts=128,
                          top_k=8, expert_width=expert_width)


MODEL_SIZES: dict[str, Qwen3MoeConfig] = {
    # For tests: 8 experts of width 32, 2 per token, 4 heads of 16 over 2 key/value heads, bytes as the vocabulary.
    "qwen3-moe-debug": Qwen3MoeConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, seq_len=64,
                                      vocab_size=256, mlp_width=128, n_experts=8, top_k=2, expert_width=32,
                                      max_position_embeddings=64, router_init_std=0.5),
    "qwen3-30b-a3b": _published(n_layers=48, d_model=2048, n_heads=32, expert_width=768, mlp_width=6144),
    "qwen3-235b-a22b": _published(n_layers=94, d_model=4096, n_heads=64, expert_width=1536, mlp_width=12288),
}


def with_overrides(base: Qwen3MoeConfig, **given) -> Qwen3MoeConfig:
    """The flags' overrides; head_dim stays the size's (models/common/shapes.py). ``--mlp-width`` sets the dense
    blocks' width, not the experts'."""
    return shapes.with_overrides(base, derive_head_dim=False, **given)


def check(cfg: Qwen3MoeConfig, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None: attention as Qwen3's. The experts are
    not tensor-parallel (and the dense blocks of a mixture run their MLP replicated: models/common/tp_plan.py)."""
    return Routing(top_k=cfg.top_k).check(cfg.n_experts) or shapes.check_attention(
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mp=mp,
        head_dim_derived=False)


def matmul_params(cfg: Qwen3MoeConfig, *, activated: bool) -> int:
    """Parameters in a token's matrix products (``activated``: k of the E experts) or in all of them: blocks with
    their norms, routers, the final norm and the head; not the embedding lookup."""
    attention = shapes.attention_params(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                        head_dim=cfg.head_dim, qk_norm=True)
    experts = cfg.top_k if activated else cfg.n_experts
    moe = cfg.d_model * cfg.n_experts + experts * 3 * cfg.d_model * cfg.expert_width  # router, experts
    dense = 3 * cfg.d_model * cfg.mlp_width
    blocks = sum(attention + (moe if kind == MOE else dense) for kind in block_kinds(cfg))
    return blocks + cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: Qwen3MoeConfig) -> float:
    """6 N_activated + attention (models/common/shapes.py)."""
    return shapes.flops_per_token(matmul_params=matmul_params(cfg, activated=True), n_layers=cfg.n_layers,
                                  seq_len=cfg.seq_len, n_heads=cfg.n_heads, head_dim=cfg.head_dim)
