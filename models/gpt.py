"""A GPT-2 style decoder-only transformer (Radford et al. 2019), written for clarity, not distribution.

Nothing here knows about ranks or meshes. Two choices make it easy to pipeline and shard:
- blocks live in a ``ModuleDict`` keyed "0".."L-1", so parameter names survive stage splitting;
- attention reshapes with ``-1`` heads, so a tensor-parallel shard with H/mp heads traces the same graph.
Input and output embeddings are untied: a tied weight would have to live on the first and last
pipeline stage at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# GPT-2's MLP hidden width per unit of d_model: the width whenever none is given.
GPT2_MLP_RATIO = 4


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    mlp_width: int  # hidden units of the MLP, GPT2_MLP_RATIO * d_model in GPT-2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Named sizes. small/medium/large are the GPT-2 shapes (Radford et al. 2019, table 2).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D). The head count is -1, never n_heads: the traced graph keeps the -1, so a
        # tensor-parallel shard holding H/mp heads (qkv: (B, T, 3D/mp)) runs the same graph.
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, H, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (B, T) int64 -> logits (B, T, V)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, D)
        for block in self.layers.values():
            x = block(x)
        return self.head(self.norm(x))


def init_weights(model: nn.Module, *, seed: int, n_layers: int) -> None:
    """Initialise every parameter from a generator seeded by (seed, parameter name).

    Keying the random stream by name, not by creation order, gives the same weights whether the whole
    model or only one pipeline stage's parameters are initialised. Residual projections are scaled by
    1/sqrt(2 * n_layers) as in GPT-2.
    """
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        with torch.no_grad():
            if name.endswith("bias"):
                value = torch.zeros(param.shape)
            elif ".ln" in name or name.startswith("norm"):
                value = torch.ones(param.shape)
            else:
                std = 0.02
                if name.endswith(("attn.o.weight", "mlp.down.weight")):
                    std /= math.sqrt(2 * n_layers)
                value = torch.randn(param.shape, generator=generator) * std
            param.copy_(value.to(dtype=param.dtype, device=param.device))


def _name_seed(seed: int, name: str) -> int:
    # A stable (not Python-hash-randomised) 63-bit mix of the seed and the name.
    h = seed & 0xFFFFFFFF
    for ch in name.encode():
        h = (h * 1000003 ^ ch) & 0x7FFFFFFFFFFFFFFF
    return h


def build_gpt(cfg: GPTConfig, *, seed: int, device: torch.device | str = "cpu") -> GPT:
    with torch.device(device):
        model = GPT(cfg)
    init_weights(model, seed=seed, n_layers=cfg.n_layers)
    return model
