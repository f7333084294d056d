"""The gpt-oss family's shapes (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", sec. 2; the hub's config.json of
openai/gpt-oss-20b and gpt-oss-120b): grouped-query attention with biases on q/k/v/o, a learned sink logit per head,
a sliding window of 128 keys on every other layer (``layer_types``: layer 0 sliding, 1 full, ...), YaRN over 4,096
original positions (factor 32, ``truncate`` false: the untruncated ramp), and in every block a mixture of experts:
a router with a bias, softmax over each token's top-k logits, experts computing the clamped SwiGLU with biases
(models/gpt_oss/experts.py).

Released sizes (both: d_model 2880, 64 query heads of 64 over 8 key/value heads, expert width 2880, top 4, vocabulary
201,088, untied, RMSNorm eps 1e-5, rope theta 150,000, context 131,072, swiglu_limit 7): ``gpt-oss-20b`` 24 layers,
32 experts; ``gpt-oss-120b`` 36 layers, 128 experts. Their parameter counts (model card, table 1): 20.91B total and
3.61B active, 116.83B and 5.13B: the totals count every parameter (both vocabulary matrices); the active counts
take the top 4 experts of each block and leave out the embedding table but not the unembedding
(tests/models/gpt_oss/test_gpt_oss_config.py checks both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.common import shapes
from models.common.rope import YaRN
from models.common.router import Routing
from models.spec import MOE, Experts, ShapeProblem

SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's layer_types
TRAINING_SEQ_LEN = 4096  # initial_context_length: the pretraining window before YaRN


def alternating_layers(n_layers: int) -> tuple[int, ...]:
    """transformers' GptOssConfig default, as the sliding layers' indices: sliding on even layers, full on odd ones."""
    return tuple(range(0, n_layers, 2))


@dataclass(frozen=True)
class GptOssConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int
    vocab_size: int
    mlp_width: int  # each expert's clamped-SwiGLU width (intermediate_size); every block is a mixture
    n_experts: int  # num_local_experts
    top_k: int  # num_experts_per_tok
    sliding_layers: tuple[int, ...]  # the layers of sliding-window attention (config.json's layer_types); others full
    sliding_window: int = 128  # a sliding layer's query i sees keys i - window < j <= i
    swiglu_limit: float = 7.0  # gate <= limit, -limit <= up <= limit
    swiglu_alpha: float = 1.702  # gate * sigmoid(alpha * gate)
    router_aux_loss_coef: float = 0.9
    tie_embeddings: bool = False
    expert_bias: bool = False  # a selection-only bias, moved by the engine's --expert-bias-rate (DeepSeek-V3)
    router_init_std: float = 0.02  # the router's initial weights; the debug size's are wide apart
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_yarn: YaRN | None = None  # rope_type "yarn" (models/common/rope.py); None: plain RoPE
    max_position_embeddings: int = 131072
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="gpt_oss", init=False)

    def __post_init__(self):
        if self.sliding_layers and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window}: must be a positive number of keys")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """config.json's per-layer attention types."""
        return tuple(SLIDING if i in self.sliding_layers else FULL for i in range(self.n_layers))

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    def routing(self) -> Routing:
        return Routing(top_k=self.top_k, gate_bias=True, topk_softmax=True, expert_bias=self.expert_bias)


def config_from_dict(d: dict) -> GptOssConfig:
    """A checkpoint manifest's dict (JSON turned tuples into lists, ``asdict`` YaRN into a dict) -> the config."""
    yarn = d.get("rope_yarn")
    return GptOssConfig(**{**d, "sliding_layers": tuple(d["sliding_layers"]),
                           "rope_yarn": YaRN(**yarn) if isinstance(yarn, dict) else yarn})


def block_kinds(cfg: GptOssConfig) -> tuple[str, ...]:
    return (MOE,) * cfg.n_layers


def attention_windows(cfg: GptOssConfig) -> tuple[int | None, ...]:
    return tuple(cfg.window(i) for i in range(cfg.n_layers))


def experts(cfg: GptOssConfig) -> Experts:
    """The mixture as the planner prices it: every block's E experts of ``mlp_width``, k per token."""
    return Experts(cfg.n_experts, cfg.top_k, cfg.mlp_width)


# gpt-oss's released RoPE: YaRN stretching 4,096 pretraining positions 32 times, the ramp not truncated.
_YARN = YaRN(factor=32.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


def _published(*, n_layers: int, n_experts: int) -> GptOssConfig:
    return GptOssConfig(n_layers=n_layers, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                        seq_len=TRAINING_SEQ_LEN, vocab_size=201088, mlp_width=2880, n_experts=n_experts, top_k=4,
                        sliding_layers=alternating_layers(n_layers), rope_yarn=_YARN)


MODEL_SIZES: dict[str, GptOssConfig] = {
    # For tests: 4 layers (sliding, full, sliding, full) with a window of 8, 4 experts of width 32 (2 per token), 4
    # heads of 16 over 2 key/value heads (q 64 wide, as d_model), bytes as the vocabulary, YaRN 4x over 16 positions.
    "gpt-oss-debug": GptOssConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, seq_len=64,
                                  vocab_size=256, mlp_width=32, n_experts=4, top_k=2, sliding_layers=alternating_layers(4),
                                  sliding_window=8, router_aux_loss_coef=0.01, router_init_std=0.5,
                                  max_position_embeddings=64,
                                  rope_yarn=YaRN(factor=4.0, original_context=16, truncate=False)),
    "gpt-oss-20b": _published(n_layers=24, n_experts=32),
    "gpt-oss-120b": _published(n_layers=36, n_experts=128),
}


def with_overrides(base: GptOssConfig, **given) -> GptOssConfig:
    """The flags' overrides; head_dim stays the size's (models/common/shapes.py); ``--mlp-width`` sets the experts'
    width. Another layer count keeps the alternation (sliding first) when the size alternates (else the sliding
    layers' indices stay)."""
    cfg = shapes.with_overrides(base, derive_head_dim=False, **given)
    if cfg.n_layers != base.n_layers and base.sliding_layers == alternating_layers(base.n_layers):
        cfg = dataclasses.replace(cfg, sliding_layers=alternating_layers(cfg.n_layers))
    return cfg


def check(cfg: GptOssConfig, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None: attention as Qwen3's (head_dim a setting
    of its own; the sinks split with the query heads); the experts are not tensor-parallel."""
    return cfg.routing().check(cfg.n_experts) or shapes.check_attention(
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mp=mp,
        head_dim_derived=False)


def attention_params(cfg: GptOssConfig) -> int:
    """One block's attention: q, k, v, o with their biases, the sinks, and the block's two RMSNorms."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return shapes.attention_params(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                   head_dim=cfg.head_dim) + q + 2 * kv + cfg.d_model + cfg.n_heads


def expert_params(cfg: GptOssConfig) -> int:
    """One expert: gate_up (D x 2F) and down (F x D) with their biases."""
    return 3 * cfg.d_model * cfg.mlp_width + 2 * cfg.mlp_width + cfg.d_model


def matmul_params(cfg: GptOssConfig, *, activated: bool) -> int:
    """Parameters in a token's matrix products (``activated``: k of the E experts) or in all of them: blocks with
    their norms, sinks and routers (with biases), the final norm and the head; not the embedding lookup."""
    experts = cfg.top_k if activated else cfg.n_experts
    router = cfg.d_model * cfg.n_experts + cfg.n_experts
    block = attention_params(cfg) + router + experts * expert_params(cfg)
    return cfg.n_layers * block + cfg.d_model + cfg.d_model * cfg.vocab_size


def keys_per_query(cfg: GptOssConfig, layer: int) -> int:
    """The keys a query's scores are counted over (PaLM's convention counts all T, ignoring the causal mask): T on
    a full layer, the window on a sliding one."""
    window = cfg.window(layer)
    return cfg.seq_len if window is None else min(cfg.seq_len, window)


def flops_per_token(cfg: GptOssConfig) -> float:
    """6 N_activated + 12 (H hd) x the keys per query summed over the layers (models/common/shapes.py's PaLM count,
    a sliding layer's attention over its window)."""
    keys = sum(keys_per_query(cfg, layer) for layer in range(cfg.n_layers))
    return 6.0 * matmul_params(cfg, activated=True) + 12.0 * keys * cfg.n_heads * cfg.head_dim
