"""A GPT-2 style decoder-only transformer (Radford et al. 2019), written for clarity, not distribution.

Nothing here knows about ranks or meshes. These choices make it easy to pipeline and shard:
- blocks live in a ``ModuleDict`` keyed "0".."L-1", so parameter names survive stage splitting;
- attention reshapes with ``-1`` heads, so a tensor-parallel shard with H/mp heads traces the same graph;
- forward creates no tensor on a device (positions slice the table), so a graph traced on "meta" runs anywhere;
- every parameter's initial value is a pure function of (seed, name, shape) (``initial_value``), so a
  rank can initialise just the shards it holds and get what the whole model would have.
The input and output embeddings are tied, as in GPT-2 (``tie_embeddings``): the LM head's weight *is*
the token embedding. A pipeline that puts them on different stages keeps a copy on each, initialised
alike and summed in backward (runtime/engine/tied.py), which is what one shared weight computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention_core import CausalAttention
from models.kv_cache import KVCache, LayerCache
from models.spec import MP, TIED_EMBEDDINGS, ShapeProblem, divisors, name_seeded_normal, run_blocks

# GPT-2's MLP hidden width per unit of d_model: the width whenever none is given.
GPT2_MLP_RATIO = 4


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int  # the training window: tokens per sample, what the engine traces (at most n_positions)
    vocab_size: int
    mlp_width: int  # hidden units of the MLP, GPT2_MLP_RATIO * d_model in GPT-2
    tie_embeddings: bool = True  # the LM head reuses the token embedding (GPT-2)
    # The model's context: rows of the learned position table (Hugging Face's n_positions). None: seq_len, as
    # in configs recorded before the two were told apart (their tables had seq_len rows).
    n_positions: int | None = None
    mtp_depth: int = 0  # multi-token-prediction depths trained beside the model (models/common/mtp.py); 0: none
    family: str = field(default="gpt2", init=False)

    def __post_init__(self) -> None:
        if self.n_positions is None:
            object.__setattr__(self, "n_positions", self.seq_len)

    @property
    def context(self) -> int:
        """Positions the model takes (its table's rows): never changed by the training window."""
        return self.n_positions

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # multi-head attention: every query head has its own key and value head


# Named sizes. small/medium/large are the GPT-2 shapes (Radford et al. 2019, table 2): 124M, 355M and 774M
# parameters with tied embeddings.
MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64, vocab_size=256, mlp_width=256),
    "small": GPTConfig(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=50257, mlp_width=3072),
    "medium": GPTConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=50257, mlp_width=4096),
    "large": GPTConfig(n_layers=36, d_model=1280, n_heads=20, seq_len=1024, vocab_size=50257, mlp_width=5120),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # One fused q/k/v projection whose output features are grouped per head, [q_h, k_h, v_h] for
        # h = 0..H-1 (Megatron-LM's layout): a column-parallel shard of it holds complete heads, the
        # input is cast to the autocast dtype once (not once each for q, k and v), and tensor
        # parallelism all-reduces the input gradient once instead of three times.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = CausalAttention()  # causal within documents, no T x T mask (models/common/attention_core.py)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # x: (B, T, D). The head count is -1, never n_heads: the traced graph keeps the -1, so a
        # tensor-parallel shard holding H/mp heads (qkv: (B, T, 3D/mp)) runs the same graph.
        # documents (B, T): packed documents' ids, attention causal within each.
        # cache: decoding (models/kv_cache.py); x holds the new tokens only.
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, H, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, H, T, hd)
        if cache is not None:
            causal = cache.causal_arguments(T, x.device)  # before update: the new queries against cached keys
            k, v = cache.update(k, v)  # (B, H, cached + T, hd)
            y = F.scaled_dot_product_attention(q, k, v, **causal)
        else:
            y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_width)
        self.down = nn.Linear(cfg.mlp_width, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Learned positions enter at the embedding; a block takes positions only to pass them on (the stages'
        # common signature). The attention is called with the inputs there are (the traced graph sees only those).
        h = self.ln1(x)
        if cache is not None:
            x = x + self.attn(h, cache=cache)
        else:
            x = x + (self.attn(h) if documents is None else self.attn(h, documents))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, share_tied_weights: bool = True):
        """``share_tied_weights=False`` builds a tied model's head with a weight of its own (to be kept
        equal to the embedding by the caller): what a pipeline that splits the two apart needs."""
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.n_positions, cfg.d_model)  # (context, D): the window uses its first T rows
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings and share_tied_weights:
            self.head.weight = self.tok_emb.weight  # (V, D) both: an embedding row is an output row

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # tokens: (B, T) int64 -> (B, T, D). The positions' embeddings are the first T rows of the table,
        # sliced rather than looked up with arange: no tensor is created on a device here, so a graph traced
        # on the meta device runs on any device unchanged. Packed documents give each token's position in
        # its document instead (B, T).
        if positions is None:
            return self.tok_emb(tokens) + self.pos_emb.weight[: tokens.shape[1]]
        return self.tok_emb(tokens) + F.embedding(positions, self.pos_emb.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # (B, T, D) -> (B, T, V)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) -> the residual stream after the last block (B, T, D), before the final norm."""
        x = self.embed(tokens, positions)
        if documents is None:  # the blocks need no positions: the embedding used them
            return run_blocks(self.layers, x, None)
        return run_blocks(self.layers, x, positions, documents)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self.decode(tokens, cache)
        return self.logits(self.hidden(tokens, positions, documents))

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """(B, t) new tokens after the cache's positions -> their logits (B, t, V). Each token's learned
        position is its place after the cached ones (the first new one's is cache.length)."""
        x = self.embed(tokens, cache.positions(tokens))
        for i, block in enumerate(self.layers.values()):
            x = block(x, cache=cache.layer(i))
        cache.advance(tokens.shape[1])
        return self.logits(x)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, cfg: GPTConfig) -> torch.Tensor:
    """The initial value of parameter ``name`` (fp32, CPU), from a generator seeded by (seed, name).

    A tied copy takes its source's name. Residual projections are scaled by 1/sqrt(2 * n_layers) as in GPT-2.
    """
    if cfg.tie_embeddings:
        name = TIED_EMBEDDINGS.get(name, name)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln" in name or name.startswith("norm"):
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("attn.o.weight", "mlp.down.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    return name_seeded_normal(name, shape, seed=seed, std=std)


def with_overrides(base: GPTConfig, *, n_layers: int | None = None, d_model: int | None = None,
                   n_heads: int | None = None, n_kv_heads: int | None = None, seq_len: int | None = None,
                   vocab_size: int | None = None, mlp_width: int | None = None,
                   tie_embeddings: bool | None = None) -> GPTConfig:
    """A named size with the flags' overrides, for a model built from scratch; the MLP is GPT2_MLP_RATIO x
    d_model unless --mlp-width is given. A new seq_len makes a table of that many positions (as Megatron-LM's
    max_position_embeddings defaults to the sequence length): rows past the window would never train. An
    existing model's window changes with ``models.with_window`` instead, which keeps its table."""
    if n_kv_heads is not None and n_kv_heads != (n_heads or base.n_heads):
        raise ValueError(f"--kv-heads {n_kv_heads}: GPT-2 models use multi-head attention (one key/value head per "
                         f"query head); grouped-query attention is the llama3 family's (--model llama3-...)")
    d = d_model or base.d_model
    return GPTConfig(n_layers=n_layers or base.n_layers, d_model=d, n_heads=n_heads or base.n_heads,
                     seq_len=seq_len or base.seq_len, n_positions=seq_len or base.n_positions,
                     vocab_size=vocab_size or base.vocab_size,
                     mlp_width=mlp_width or (base.mlp_width if d_model is None else GPT2_MLP_RATIO * d),
                     tie_embeddings=base.tie_embeddings if tie_embeddings is None else tie_embeddings)


def check(cfg: GPTConfig, mp: int) -> ShapeProblem | None:
    """Why ``cfg`` cannot run with ``mp``-way tensor parallelism (heads, the model width and the MLP width split
    over mp), or None."""
    if cfg.d_model % cfg.n_heads:
        return ShapeProblem("n_heads", cfg.n_heads, "divide", "d_model", cfg.d_model, valid=divisors(cfg.d_model))
    for split, size in (("d_model", cfg.d_model), ("n_heads", cfg.n_heads), ("mlp_width", cfg.mlp_width)):
        if size % mp:
            return ShapeProblem(MP, mp, "divide", split, size, valid=divisors(size))
    return None


def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in matrix products: blocks (with their norms and biases) and the head."""
    d, f, V = cfg.d_model, cfg.mlp_width, cfg.vocab_size
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d  # attention, MLP, two layer norms
    return cfg.n_layers * block + 2 * d + d * V  # + final norm + head


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token, 6N + 12 L T d (PaLM, Chowdhery et al. 2022, appendix B): N counts the
    matrix-product parameters (not the embedding lookups); the second term is attention's QK^T and AV,
    forward and backward. Recomputation is not counted: MFU measures useful work."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.seq_len * cfg.d_model


def build(cfg: GPTConfig, *, share_tied_weights: bool = True) -> GPT:
    return GPT(cfg, share_tied_weights=share_tied_weights)
