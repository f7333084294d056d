"""The decoder Llama 3, Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3 share: pre-norm blocks of an attention (grouped-query,
or multi-head latent: latent_attention.py) and a feed-forward part, RMSNorms, an untied or tied LM head. Families build
it from their configs (their model.py).

It follows the naming contract of models/spec.py (``tok_emb``, ``layers.<i>``, ``norm``, ``head``; ``embed``,
``logits``; heads as -1 in every reshape) and the tracing rules the engine needs: forward creates no tensor
on a device of its own and the model has no buffers (the engine materialises parameters only).

A block is ``attn_norm``, ``attn``, ``mlp_norm`` and either ``mlp`` (a dense SwiGLU) or ``moe`` (moe.py): the two
feed-forward kinds have different names, so that tensor-parallel plans and checkpoints tell them apart.

Inputs: ``forward(tokens, positions, documents)``: ``positions`` (B, T) int64 rotate q and k (each token's position
within its document for packed documents, or its global position in a context-parallel slice); ``documents``
(B, T) int64 make attention causal within each document (attention_core.py). Without them: positions 0..T-1
and plain causal attention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.common.moe import MoE
from models.common.norm import RMSNorm
from models.kv_cache import KVCache, LayerCache
from models.spec import TIED_EMBEDDINGS, name_seeded_normal, run_blocks

# Parameters whose output joins the residual stream: initialised smaller (below).
RESIDUAL_PROJECTIONS = ("attn.o.weight", "mlp.down.weight", "experts.w2", "shared_experts.down.weight")
NON_TRAINABLE = ("router.expert_bias",)  # start at zero, moved by the bias update (load_balance.py)


class Block(nn.Module):
    def __init__(self, *, attn: nn.Module, feed_forward: nn.Module, d_model: int, norm_eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(d_model, norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(d_model, norm_eps)
        self.ffn_name = "moe" if isinstance(feed_forward, MoE) else "mlp"  # the feed-forward submodule's name
        self.add_module(self.ffn_name, feed_forward)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Pre-norm residual blocks. The attention is called with the inputs there are, so that the traced graph
        # (and any input hook on it) sees only those.
        h = self.attn_norm(x)
        if cache is not None:
            x = x + self.attn(h, positions, cache=cache)
        else:
            x = x + self.attn(h, *(t for t in (positions, documents) if t is not None))
        return x + self.get_submodule(self.ffn_name)(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, blocks: list[Block], *, vocab_size: int, d_model: int, norm_eps: float, tie_embeddings: bool,
                 share_tied_weights: bool = True):
        """``share_tied_weights=False`` builds a tied model's head with a weight of its own (to be kept equal
        to the embedding by the caller): what a pipeline that splits the two apart needs."""
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(d_model, norm_eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings and share_tied_weights:
            self.head.weight = self.tok_emb.weight  # (V, D) both

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) int64 -> (B, T, D). Positions enter in every block (RoPE), not here; the argument keeps the
        signature of forward."""
        return self.tok_emb(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # (B, T, D) -> (B, T, V)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) -> the residual stream after the last block (B, T, D), before the final norm."""
        return run_blocks(self.layers, self.embed(tokens, positions), positions, documents)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self.decode(tokens, cache)
        return self.logits(self.hidden(tokens, positions, documents))

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """(B, t) new tokens after the cache's positions -> their logits (B, t, V). RoPE rotates each at its
        place after the cached ones (the first new one's is cache.length)."""
        positions = cache.positions(tokens)
        x = self.tok_emb(tokens)
        for i, block in enumerate(self.layers.values()):
            x = block(x, positions, cache=cache.layer(i))
        cache.advance(tokens.shape[1])
        return self.logits(x)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, n_layers: int,
                  tie_embeddings: bool, router_std: float = 0.02) -> torch.Tensor:
    """The initial value of parameter ``name`` (fp32, CPU), from a generator seeded by (seed, name): N(0, 0.02)
    for matrices, stacked experts and the embedding, residual projections (``RESIDUAL_PROJECTIONS``) scaled by
    1/sqrt(2 * n_layers) (GPT-2's rule), routers N(0, router_std), norms ones, a router's selection bias zeros. A
    tied copy takes its source's name."""
    if tie_embeddings:
        name = TIED_EMBEDDINGS.get(name, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(NON_TRAINABLE):
        return torch.zeros(shape)
    std = router_std if name.endswith("router.gate.weight") else 0.02
    if name.endswith(RESIDUAL_PROJECTIONS):
        std /= math.sqrt(2 * n_layers)
    return name_seeded_normal(name, shape, seed=seed, std=std)
