"""The DeepSeek-V3 family's shapes (DeepSeek-V3 Technical Report, DeepSeek-AI 2024, sec. 4.2; the hub's config.json of
deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite): multi-head latent attention (models/common/latent_attention.py) with
YaRN, and a mixture of experts with DeepSeek-V3's router (sigmoid scores, group-limited top-k, the selection-only
``e_score_correction_bias``, weights renormalised then times ``routed_scaling_factor``) and shared experts, after
``first_k_dense`` dense blocks (``first_k_dense_replace``).

Sizes: ``deepseek-v3`` is the released 671B model (37B activated; its one multi-token-prediction depth: ``--mtp-depth 1``);
``deepseek-v3-16b`` DeepSeek-V2-Lite's shape (torchtitan's "16B": 15.7B, 2.4B activated; no q LoRA rank) with V3's
router and YaRN (V2-Lite's mscale 0.707); ``deepseek-v3-debug`` a tiny model for tests with every part of the real
sizes (a q LoRA rank, dense and MoE blocks, groups, YaRN with its softmax factor, a v head dimension of its own),
``deepseek-v3-16b-debug`` the 16b's structure at that scale (no q LoRA rank, two shared experts).
``mtp_depth`` is config.json's ``num_nextn_predict_layers`` (multi-token prediction, models/common/mtp.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.common import shapes
from models.common.moe import block_kinds as kinds_of_blocks
from models.common.rope import YaRN
from models.common.router import SIGMOID, Routing
from models.spec import MOE, MP, Experts, LatentSizes, ShapeProblem, divisors


@dataclass(frozen=True)
class DeepseekV3Config:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    mlp_width: int  # the dense blocks' SwiGLU width (intermediate_size)
    q_lora_rank: int  # 0 (config.json: null): one q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    expert_width: int  # each routed and shared expert's SwiGLU width (moe_intermediate_size)
    n_shared_experts: int = 1
    first_k_dense: int = 0  # first_k_dense_replace: blocks 0 .. k-1 keep the dense MLP
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    expert_bias: bool = True  # e_score_correction_bias (selection only; moved by --expert-bias-rate)
    router_aux_loss_coef: float = 0.0001  # the sequence-wise balance loss's alpha (report sec. 4.2: 0.0001)
    rope_theta: float = 10000.0
    rope_yarn: YaRN | None = None  # rope_type "yarn" (models/common/rope.py); None: plain RoPE
    rope_interleave: bool = True  # the rope features stored as adjacent pairs (transformers' default for this family)
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    router_init_std: float = 0.02  # the router's initial weights; the debug size's are wide apart
    family: str = field(default="deepseek_v3", init=False)

    @property
    def context(self) -> int:
        """Positions the model takes (its published context): never changed by the training window."""
        return self.max_position_embeddings

    @property
    def n_kv_heads(self) -> int:
        """Latent attention expands one key and one value per query head (there is no grouped sharing)."""
        return self.n_heads

    def latent(self) -> LatentSizes:
        return LatentSizes(n_heads=self.n_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                           nope_dim=self.qk_nope_head_dim, rope_dim=self.qk_rope_head_dim, v_dim=self.v_head_dim)

    def routing(self) -> Routing:
        return Routing(top_k=self.top_k, score_func=SIGMOID, norm_topk_prob=self.norm_topk_prob, n_group=self.n_group,
                       topk_group=self.topk_group, expert_bias=self.expert_bias,
                       routed_scaling_factor=self.routed_scaling_factor)

    def softmax_factor(self) -> float:
        """The softmax scale's multiplier under YaRN (DeepSeek's m(factor, mscale_all_dim)^2), else 1."""
        return self.rope_yarn.softmax_factor() if self.rope_yarn is not None else 1.0


def block_kinds(cfg: DeepseekV3Config) -> tuple[str, ...]:
    return kinds_of_blocks(cfg.n_layers, first_k_dense=cfg.first_k_dense)


def experts(cfg: DeepseekV3Config) -> Experts:
    """E routed experts of ``expert_width``, k per token, and the shared experts (one SwiGLU of n_shared x the
    width); the first ``first_k_dense`` blocks keep the dense SwiGLU of ``mlp_width``."""
    return Experts(cfg.n_experts, cfg.top_k, cfg.expert_width, shared=1 if cfg.n_shared_experts else 0,
                   shared_width=cfg.n_shared_experts * cfg.expert_width, dense_layers=tuple(range(cfg.first_k_dense)))


def latent_attention(cfg: DeepseekV3Config) -> LatentSizes:
    return cfg.latent()


def config_from_dict(d: dict) -> DeepseekV3Config:
    """A checkpoint manifest's dict (``dataclasses.asdict`` made YaRN a dict) -> the config."""
    yarn = d.get("rope_yarn")
    # Manifests written before multi-token prediction trained kept the folder's ``num_nextn_predict_layers`` but built
    # no modules for it: those runs had none.
    d = {k: v for k, v in d.items() if k != "num_nextn_predict_layers"}
    return DeepseekV3Config(**{**d, "rope_yarn": YaRN(**yarn) if isinstance(yarn, dict) else yarn})


# DeepSeek-V3's released RoPE: YaRN stretching 4,096 pretraining positions 40 times (V2-Lite: mscale 0.707).
_YARN = YaRN(factor=40.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
_PUBLISHED = dict(seq_len=4096, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                  max_position_embeddings=163840)

MODEL_SIZES: dict[str, DeepseekV3Config] = {
    # For tests: 1 dense and 2 MoE blocks, 8 experts in 4 groups (2 chosen), top 2 + 1 shared, a q LoRA rank, v heads
    # wider than q/k heads, bytes as the vocabulary; YaRN 4x over 64 original positions keeps, blends and divides its
    # 4 rope frequencies (ramp 0, 0.5, 1, 1) and multiplies the softmax scale by 1.296.
    "deepseek-v3-debug": DeepseekV3Config(
        n_layers=3, d_model=64, n_heads=4, seq_len=64, vocab_size=256, mlp_width=128, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_experts=8, top_k=2, expert_width=32, first_k_dense=1,
        n_group=4, topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=64, router_init_std=0.5,
        rope_yarn=YaRN(factor=4.0, original_context=64, mscale=1.0, mscale_all_dim=1.0)),
    # For tests: deepseek-v3-16b's structure (no q LoRA rank, two shared experts, no expert groups, V2-Lite's YaRN
    # mscale) at the debug size's scale.
    "deepseek-v3-16b-debug": DeepseekV3Config(
        n_layers=3, d_model=64, n_heads=4, seq_len=64, vocab_size=256, mlp_width=128, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_experts=8, top_k=2, expert_width=32, n_shared_experts=2,
        first_k_dense=1, max_position_embeddings=64, router_init_std=0.5,
        rope_yarn=YaRN(factor=4.0, original_context=64, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek-v3-16b": DeepseekV3Config(
        n_layers=27, d_model=2048, n_heads=16, vocab_size=102400, mlp_width=10944, q_lora_rank=0, n_experts=64,
        top_k=6, expert_width=1408, n_shared_experts=2, first_k_dense=1,
        rope_yarn=dataclasses.replace(_YARN, mscale=0.707, mscale_all_dim=0.707), **_PUBLISHED),
    "deepseek-v3": DeepseekV3Config(
        n_layers=61, d_model=7168, n_heads=128, vocab_size=129280, mlp_width=18432, q_lora_rank=1536, n_experts=256,
        top_k=8, expert_width=2048, n_shared_experts=1, first_k_dense=3, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, rope_yarn=_YARN, **_PUBLISHED),
}

_FLAG_FIELDS = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "mlp_width", "tie_embeddings")


def with_overrides(base: DeepseekV3Config, **given) -> DeepseekV3Config:
    """The flags' overrides; the latent and head dimensions stay the size's. ``--mlp-width`` sets the dense blocks'
    width, not the experts'. ``--kv-heads`` has no meaning here (ValueError naming it)."""
    fields = {k: v for k, v in given.items() if v is not None}
    if "n_kv_heads" in fields:
        raise ValueError(f"--kv-heads {fields['n_kv_heads']}: multi-head latent attention has a key and a value per "
                         f"head (--heads); drop --kv-heads")
    unknown = sorted(set(fields) - set(_FLAG_FIELDS))
    if unknown:
        raise TypeError(f"unknown overrides {unknown}")
    cfg = dataclasses.replace(base, **fields)
    return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, cfg.seq_len))


def check(cfg: DeepseekV3Config, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism, or None: q and kv_b are split by heads, a dense
    block's MLP by its width (the experts, the down projections and their norms are not split)."""
    problem = cfg.routing().check(cfg.n_experts)
    if problem:
        return problem
    if cfg.n_heads <= 0:
        return ShapeProblem("n_heads", cfg.n_heads, "be positive")
    if cfg.qk_rope_head_dim % 2:
        return ShapeProblem("qk_rope_head_dim", cfg.qk_rope_head_dim, "be even", reason="for rotary embeddings")
    if cfg.n_heads % mp:
        return ShapeProblem(MP, mp, "divide", "n_heads", cfg.n_heads, valid=divisors(cfg.n_heads))
    return shapes.check_width(cfg.mlp_width, mp) if cfg.first_k_dense else None


def matmul_params(cfg: DeepseekV3Config, *, activated: bool) -> int:
    """Parameters in a token's matrix products (``activated``: k of the E routed experts) or in all of them: blocks
    with their norms, routers, the final norm and the head; not the embedding lookup."""
    s, d = cfg.latent(), cfg.d_model
    attention = sum(i * o for i, o in s.matrices(d).values()) + s.norm_params() + 2 * d  # and the block's two norms
    routed = cfg.top_k if activated else cfg.n_experts
    moe = d * cfg.n_experts + (routed + cfg.n_shared_experts) * 3 * d * cfg.expert_width
    dense = 3 * d * cfg.mlp_width
    blocks = sum(attention + (moe if kind == MOE else dense) for kind in block_kinds(cfg))
    return blocks + d + d * cfg.vocab_size


def attention_head_dim(cfg: DeepseekV3Config) -> float:
    """The head dimension that prices QK^T and AV: (qk + v) / 2 (q.k over nope + rope features, p.v over v)."""
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2


def flops_per_token(cfg: DeepseekV3Config) -> float:
    """6 N_activated + attention (models/common/shapes.py), with attention's head dimension (qk + v) / 2."""
    return shapes.flops_per_token(matmul_params=matmul_params(cfg, activated=True), n_layers=cfg.n_layers,
                                  seq_len=cfg.seq_len, n_heads=cfg.n_heads, head_dim=attention_head_dim(cfg))
