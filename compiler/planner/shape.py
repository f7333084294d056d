"""A decoder's shape as the planner prices it, in closed form: no module is built, so a 405B shape (or a
235B mixture of experts) costs what a 124M one does.

``DecoderShape`` is read from any family's spec (models/spec.py: its config's sizes, its ``Architecture``
and its ``Experts``), so a new family is priced without planner code. A block is attention plus an MLP:
dense (GELU: up, down; SwiGLU: gate, up, down) or a mixture of experts (a router, ``top_k`` of ``count``
routed experts and ``shared`` experts, each an MLP of the family's kind); ``Experts.dense_layers`` keeps
the dense MLP in the blocks it lists (first-k-dense).

Sliding-window attention (gpt-oss's ``attention_windows``): a block whose queries see the last W keys is a kind of its
own (``"moe@128"``: its MLP's kind, then its window; ``mlp_kind`` and ``window_of`` read them), whose QK^T and AV run
over min(T, W) keys per query where a full block's run over T. Attention sinks add one parameter per head, a router's
bias (``biases``) one per expert.

Multi-head latent attention (DeepSeek-V3; the spec's ``LatentSizes``) is priced by its own matrices: the replicated
down projections ``q_a`` and ``kv_a``, the column-parallel ``q`` and ``kv_b`` and the row-parallel ``o``, and the two
latent norms; its QK^T and AV take ``head_dim`` (q/k width + v width) / 2, which counts both products' FLOPs. Its
saved activations have a closed form of their own (attention_memory.py ``engine_latent_attention``: the latents, their
norms, q, k, kv_b's output).

FLOPs (the FlopCounterMode convention, what compiler/cost.py counts on the engine's model): a matrix
product [M, K] x [K, N] is 2MNK forward and 4MNK backward; attention's QK^T and AV are 4 T^2 (H hd) per
sequence forward without a causal discount, and torch counts their backward as 2.5x forward. Per TP
shard (t = mp): the Megatron layout, q/k/v and up/gate split by output features, o and down by input
features, the embedding and head by vocabulary rows. Experts are not split by TP (expert tensor
parallelism 1, as torchtitan and Megatron's defaults): expert parallelism (ep) holds count / ep of them.

Saved activations (the bytes autograd keeps) live in compiler/planner/activations.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from models import mtp_depth, spec_of
from models.spec import Experts, LatentSizes

DENSE, MOE = "dense", "moe"  # the two kinds of block's MLP
_WINDOW = "@"  # a kind's window follows it: "moe@128"


def mlp_kind(kind: str) -> str:
    """DENSE or MOE: the MLP of a block of ``kind``."""
    return kind.partition(_WINDOW)[0]


def window_of(kind: str) -> int | None:
    """The sliding window of a block of ``kind``'s attention, None for full causal attention."""
    window = kind.partition(_WINDOW)[2]
    return int(window) if window else None


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int  # the dense MLP's hidden width (every block's when there are no experts)
    mlp: str  # "gelu" (up, GELU, down) | "swiglu" (down(silu(gate x) * up x)); experts are MLPs of this kind
    seq_len: int
    vocab_size: int
    tied: bool  # the LM head is the token embedding
    biases: bool  # linear layers and norms carry biases (GPT-2) or not (Llama)
    norm: str  # "layernorm" | "rmsnorm"
    positions: str = "learned"  # "learned" (a [context, d] table, GPT-2) | "rope" (no parameters)
    fused_qkv: bool = True  # one q/k/v projection (GPT-2) or three (Llama)
    qk_norm: bool = False  # a norm over each head's q and k (Qwen3)
    experts: Experts | None = None  # a mixture-of-experts MLP (models/spec.py), None: dense
    context: int | None = None  # positions the model takes (a learned table's rows); None: seq_len
    latent: LatentSizes | None = None  # multi-head latent attention (models/spec.py), None: grouped-query attention
    windows: tuple[int | None, ...] = ()  # each block's sliding window, None for full attention (empty: all full)
    sinks: bool = False  # a learned sink logit per head (gpt-oss)
    mtp_depth: int = 0  # multi-token-prediction depths on the last stage (models/common/mtp.py): priced with the head

    @property
    def position_rows(self) -> int:
        """Rows of a learned position table: the model's context, whatever window it trains on."""
        return self.context or self.seq_len

    @staticmethod
    def from_config(cfg) -> "DecoderShape":
        """From any registered family's config: its sizes, its ``Architecture`` and its ``Experts``."""
        spec = spec_of(cfg)
        arch, latent = spec.architecture, spec.latent_attention(cfg)
        head_dim = cfg.head_dim if latent is None else (latent.qk_dim + latent.v_dim) // 2
        return DecoderShape(
            layers=cfg.n_layers, d_model=cfg.d_model, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
            head_dim=head_dim, mlp_width=cfg.mlp_width, mlp=arch.mlp, seq_len=cfg.seq_len,
            vocab_size=cfg.vocab_size, tied=cfg.tie_embeddings, biases=arch.biases, norm=arch.norm,
            positions=arch.positions, fused_qkv=arch.fused_qkv, qk_norm=arch.qk_norm, experts=spec.experts(cfg),
            context=cfg.context, latent=latent, sinks=arch.sinks, mtp_depth=mtp_depth(cfg),
            windows=() if not any(spec.attention_windows(cfg)) else spec.attention_windows(cfg))

    @staticmethod
    def from_flags(*, layers: int, d_model: int, heads: int, seq_len: int, vocab_size: int, kv_heads: int | None = None,
                   mlp_width: int | None = None, mlp: str = "gelu", tied: bool | None = None,
                   head_dim: int | None = None, experts: Experts | None = None, qk_norm: bool = False) -> "DecoderShape":
        """``run.py plan --layers --d-model --heads [--kv-heads] [--mlp-width] [--mlp] --seq-len --vocab-size``
        (and ``--experts --top-k --expert-width ...``): GELU shapes are GPT-2-like (width 4d), SwiGLU shapes
        Llama-like (width from Llama's rule, 8d/3 rounded up to a multiple of 256)."""
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"--mlp must be gelu or swiglu, got {mlp}")
        llama = mlp == "swiglu"
        width = mlp_width or default_mlp_width(mlp, d_model)
        return DecoderShape(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads or heads,
                            head_dim=head_dim or d_model // heads, mlp_width=width, mlp=mlp, seq_len=seq_len,
                            vocab_size=vocab_size, tied=(not llama) if tied is None else tied, biases=not llama,
                            norm="rmsnorm" if llama else "layernorm", positions="rope" if llama else "learned",
                            fused_qkv=not llama, qk_norm=qk_norm, experts=experts)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def kind(self, layer: int) -> str:
        """DENSE or MOE, the MLP block ``layer`` has, and its attention window if it slides ("moe@128")."""
        mlp = DENSE if self.experts is None or layer in self.experts.dense_layers else MOE
        window = self.windows[layer] if layer < len(self.windows) else None  # MTP depths past L: full attention
        return mlp if window is None else f"{mlp}{_WINDOW}{window}"

    def keys(self, kind: str) -> int:
        """The keys a query's QK^T and AV run over, the causal mask aside (PaLM's and FlopCounterMode's count): T,
        or the window of a sliding block."""
        window = window_of(kind)
        return self.seq_len if window is None else min(self.seq_len, window)

    def kinds(self) -> list[str]:
        return list(self._kinds)

    def mtp_kinds(self) -> list[str]:
        """The MTP depths' blocks' kinds: the family's blocks L .. L + D - 1 (DeepSeek-V3's: a mixture of experts)."""
        return [self.kind(self.layers + k) for k in range(self.mtp_depth)]

    @cached_property
    def _kinds(self) -> tuple[str, ...]:
        return tuple(self.kind(i) for i in range(self.layers))

    def shard_error(self, mp: int) -> str | None:
        """Why ``mp`` tensor-parallel ranks cannot split this shape (heads, kv heads, MLP), or None."""
        widths = [("--heads", self.heads), ("--kv-heads", self.kv_heads)]
        if DENSE in map(mlp_kind, self.kinds()):
            widths.append(("--mlp-width", self.mlp_width))
        for name, n in widths:
            if n % mp:
                return f"--mp {mp} must divide {name} {n}"
        return None

    def expert_error(self, ep: int) -> str | None:
        if ep == 1:
            return None
        if self.experts is None:
            return "--ep needs a mixture-of-experts model"
        if self.experts.count % ep:
            return f"--ep {ep} must divide the {self.experts.count} experts"
        return None


def default_mlp_width(mlp: str, d_model: int) -> int:
    """GPT-2's 4 d; for SwiGLU Llama's rule without a multiplier: 2/3 of 4 d, rounded up to 256."""
    return -(-8 * d_model // 3 // 256) * 256 if mlp == "swiglu" else 4 * d_model


def _norm_params(shape: DecoderShape) -> int:
    return 2 * shape.d_model if shape.norm == "layernorm" and shape.biases else shape.d_model


def attention_matrices(shape: DecoderShape, mp: int) -> dict[str, tuple[int, int]]:
    """(input, output) features of each attention linear of a block on one TP shard (Megatron layout)."""
    d, t = shape.d_model, mp
    if shape.latent is not None:  # q and kv_b split their heads' outputs, o its inputs; q_a and kv_a replicated
        whole = shape.latent.matrices(d)
        split = {"q": (whole["q"][0], whole["q"][1] // t), "kv_b": (whole["kv_b"][0], whole["kv_b"][1] // t),
                 "o": (whole["o"][0] // t, d)}
        return {**whole, **split}
    if shape.fused_qkv:
        mats = {"qkv": (d, (shape.q_width + 2 * shape.kv_width) // t)}
    else:
        mats = {"q": (d, shape.q_width // t), "k": (d, shape.kv_width // t), "v": (d, shape.kv_width // t)}
    mats["o"] = (shape.q_width // t, d)
    return mats


def mlp_matrices(shape: DecoderShape, width: int, shards: int = 1) -> dict[str, tuple[int, int]]:
    """(input, output) features of one MLP of hidden ``width`` split over ``shards`` TP ranks."""
    d, f = shape.d_model, width // shards
    mats = {"up": (d, f), "down": (f, d)}
    if shape.mlp == "swiglu":
        mats["gate"] = (d, f)
    return mats


def tensor_parallel_modules(shape: DecoderShape, kind: str, *, sequence_parallel: bool) -> int:
    """Modules of one block that the tensor-parallel plan turns into DTensor modules (models/common/tp_plan.py,
    models/gpt2/tp_plan.py): each attention and dense-MLP linear, Qwen3's two per-head norms and, with SP, the
    two sequence-sharded norms and the sequence gathers before attention and a dense MLP. A mixture-of-experts
    MLP is not tensor-parallel. Each costs DTensor's dispatch at its boundaries (devices.py ``CpuDevice``). Latent
    attention: q, kv_b, o and the shared RoPE key's gradient sum, and with SP its down projections q_a and kv_a."""
    modules = len(attention_matrices(shape, 1)) + (2 if shape.qk_norm else 0)
    replicated = 0
    if shape.latent is not None:
        replicated = modules - 3  # q_a, kv_a: DTensors under SP only
        modules = 4
    modules += 1 if shape.sinks else 0  # the sinks, split with the heads
    if mlp_kind(kind) == DENSE:
        modules += len(mlp_matrices(shape, shape.mlp_width))
    if sequence_parallel:
        modules += (4 if mlp_kind(kind) == DENSE else 3) + replicated
    return modules


def _block_matrices(shape: DecoderShape, mp: int) -> dict[str, tuple[int, int]]:
    """A dense block's linear layers on one TP shard."""
    return {**attention_matrices(shape, mp), **mlp_matrices(shape, shape.mlp_width, mp)}


def _weights(mats: dict[str, tuple[int, int]], biases: bool) -> int:
    return sum(i * o + (o if biases else 0) for i, o in mats.values())


def shared_width(experts: Experts) -> int:
    return experts.shared_width or experts.width


@dataclass(frozen=True)
class BlockParams:
    """One block's parameters on one rank, by how data parallelism shards them."""
    dense: int  # attention, norms, router, shared experts, a dense MLP: replicated over dp (and cp)
    experts: int  # routed experts held by this rank (count / ep of them): sharded over the expert-DP group

    @property
    def total(self) -> int:
        return self.dense + self.experts


def block_params(shape: DecoderShape, mp: int = 1, *, kind: str = DENSE, ep: int = 1) -> BlockParams:
    """Parameters of one block held by one rank; row-parallel biases, the norms, the router and (with
    expert tensor parallelism 1) the experts are not split by TP."""
    norms = 2 * _norm_params(shape) + (2 * shape.head_dim if shape.qk_norm else 0) + (
        shape.latent.norm_params() if shape.latent is not None else 0)
    attention = _weights(attention_matrices(shape, mp), shape.biases) + (shape.heads // mp if shape.sinks else 0)
    if mlp_kind(kind) == DENSE:
        return BlockParams(attention + _weights(mlp_matrices(shape, shape.mlp_width, mp), shape.biases) + norms, 0)
    e = shape.experts
    router = (shape.d_model + (1 if shape.biases else 0)) * e.count
    shared = e.shared * _weights(mlp_matrices(shape, shared_width(e), mp), shape.biases)
    routed = e.count // ep * _weights(mlp_matrices(shape, e.width), shape.biases)
    return BlockParams(attention + norms + router + shared, routed)


def lora_block_params(shape: DecoderShape, mp: int = 1, *, kind: str = DENSE, ep: int = 1, rank: int,
                      targets: tuple[str, ...]) -> BlockParams:
    """LoRA's adapters of one block on one rank (compiler/lora/): r (in + out) for each targeted matrix of the TP
    shard (a column-parallel matrix keeps A whole and B's rows of its shard, a row-parallel one A's columns of its
    shard and B whole: r (in + out) of the shard's (in, out) either way); ``experts`` adapts each routed expert."""
    def adapters(mats: dict[str, tuple[int, int]], names: tuple[str, ...]) -> int:
        return sum(rank * (i + o) for name, (i, o) in mats.items() if name in names)

    dense = adapters(attention_matrices(shape, mp), targets)
    if kind == DENSE:
        return BlockParams(dense + adapters(mlp_matrices(shape, shape.mlp_width, mp), targets), 0)
    e = shape.experts
    dense += e.shared * adapters(mlp_matrices(shape, shared_width(e), mp), targets)
    routed = e.count // ep * adapters(mlp_matrices(shape, e.width), tuple(mlp_matrices(shape, e.width))) \
        if "experts" in targets else 0
    return BlockParams(dense, routed)


def embedding_params(shape: DecoderShape, mp: int = 1) -> int:
    rows = -(-shape.vocab_size // mp)
    return rows * shape.d_model + (shape.position_rows * shape.d_model if shape.positions == "learned" else 0)


def head_params(shape: DecoderShape, mp: int = 1) -> int:
    """The final norm and the LM head's rows on one TP rank (a tied head's weight counted here too)."""
    return _norm_params(shape) + -(-shape.vocab_size // mp) * shape.d_model


def mtp_params(shape: DecoderShape, mp: int = 1, *, ep: int = 1) -> BlockParams:
    """The MTP depths' parameters on the last stage's rank beside the head's: each depth's block, its 2d -> d
    projection and three norms (replicated over mp), and the embedding's copy (its vocabulary rows)."""
    if not shape.mtp_depth:
        return BlockParams(0, 0)
    blocks = [block_params(shape, mp, kind=kind, ep=ep) for kind in shape.mtp_kinds()]
    own = shape.mtp_depth * (2 * shape.d_model * shape.d_model + 3 * _norm_params(shape))
    return BlockParams(sum(b.dense for b in blocks) + own + -(-shape.vocab_size // mp) * shape.d_model,
                       sum(b.experts for b in blocks))


def _mtp_active(shape: DecoderShape) -> int:
    """One token's MTP parameters in matrix products: each depth's activated block, projection and the head again."""
    return sum(_active_block_params(shape, k) + 2 * shape.d_model * shape.d_model + head_params(shape)
               for k in shape.mtp_kinds())


def _per_kind(shape: DecoderShape, f) -> float:
    """The sum of ``f(kind)`` over the blocks (one evaluation per kind)."""
    kinds = shape.kinds()
    return sum(kinds.count(k) * f(k) for k in set(kinds))


def parameter_count(shape: DecoderShape) -> int:
    """Every distinct parameter (a tied head counted once; every expert)."""
    head = head_params(shape) - (shape.vocab_size * shape.d_model if shape.tied else 0)
    blocks = _per_kind(shape, lambda k: block_params(shape, kind=k).total)
    mtp = mtp_params(shape).total - (shape.vocab_size * shape.d_model if shape.mtp_depth else 0)  # a tied copy
    return embedding_params(shape) + blocks + head + mtp


def _active_block_params(shape: DecoderShape, kind: str) -> int:
    """A block's parameters one token's forward uses: all of a dense block, ``top_k`` of a MoE's routed experts."""
    p = block_params(shape, kind=kind)
    if mlp_kind(kind) == DENSE:
        return p.total
    e = shape.experts
    return p.dense + e.top_k * p.experts // e.count


def activated_parameter_count(shape: DecoderShape) -> int:
    head = head_params(shape) - (shape.vocab_size * shape.d_model if shape.tied else 0)
    mtp = sum(_active_block_params(shape, k) + 2 * shape.d_model * shape.d_model + 3 * _norm_params(shape)
              for k in shape.mtp_kinds())
    return embedding_params(shape) + _per_kind(shape, lambda k: _active_block_params(shape, k)) + head + mtp


def matmul_params(shape: DecoderShape) -> int:
    """N of MFU's 6N: activated block parameters, final norm and head, not the embedding lookups
    (compiler/flops.py's count; for a MoE the routed experts a token uses)."""
    return _per_kind(shape, lambda k: _active_block_params(shape, k)) + head_params(shape) + _mtp_active(shape)


def attention_keys(shape: DecoderShape) -> float:
    """The keys per query summed over the blocks: L T without sliding windows (each block's ``keys``)."""
    return _per_kind(shape, shape.keys)


def model_flops_per_token(shape: DecoderShape) -> float:
    """PaLM's count (Chowdhery et al. 2022, appendix B): 6N + 12 L T (H hd), no recompute; a sliding block's T is
    its window (``attention_keys``), the MTP depths' blocks count as layers."""
    depth_keys = sum(shape.keys(kind) for kind in shape.mtp_kinds())
    return 6.0 * matmul_params(shape) + 12.0 * (attention_keys(shape) + depth_keys) * shape.q_width


def hardware_flops_per_token(shape: DecoderShape, *, activation_checkpointing: bool) -> float:
    """Megatron's count (Narayanan et al. 2021, sec. 5.1): with full recompute the blocks run forward
    twice, 8N + 16 L T (H hd) for them; the head 6 N_head. For GPT shapes this is their
    96 B s l h^2 (1 + s / 6h + V / 16lh) per B s tokens (up to biases and norms)."""
    passes = 4 if activation_checkpointing else 3
    blocks = _per_kind(shape, lambda k: _active_block_params(shape, k))
    return 2 * passes * blocks + 6 * head_params(shape) + 4 * passes * attention_keys(shape) * shape.q_width


def megatron_model_flops_per_token(shape: DecoderShape) -> float:
    """Megatron-Core's count of today (megatron/training's ``num_floating_point_operations``): 6 x the
    activated matrix parameters (blocks and logits) plus causal attention, 6 L T (H hd): half of PaLM's
    12 L T (H hd), which counts the masked half. No recompute."""
    blocks = _per_kind(shape, lambda k: _active_block_params(shape, k))
    return 6.0 * (blocks + shape.vocab_size * shape.d_model) + 6.0 * attention_keys(shape) * shape.q_width


def block_forward_flops(shape: DecoderShape, *, micro_batch_size: int, mp: int = 1,
                        kind: str = DENSE) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of one block for one micro-batch on one TP rank; for a MoE block
    the matmuls one rank's tokens run through the router, their ``top_k`` experts and the shared ones
    (where they run does not change the count)."""
    tokens = micro_batch_size * shape.seq_len
    attention = 4.0 * tokens * shape.keys(kind) * shape.q_width / mp
    mats = attention_matrices(shape, mp)
    if mlp_kind(kind) == DENSE:
        mats = {**mats, **mlp_matrices(shape, shape.mlp_width, mp)}
        return 2.0 * tokens * sum(i * o for i, o in mats.values()), attention
    e = shape.experts
    per_token = sum(i * o for i, o in mats.values()) + shape.d_model * e.count
    per_token += e.shared * sum(i * o for i, o in mlp_matrices(shape, shared_width(e), mp).values())
    per_token += e.top_k * sum(i * o for i, o in mlp_matrices(shape, e.width).values()) / mp
    return 2.0 * tokens * per_token, attention
