"""Per-layer cost estimates used to place layers on pipeline stages.

Costs are training FLOPs (forward + backward = 3x forward) of one micro-batch, counted analytically
from the matrix products (Narayanan et al. 2021, sec. 5.1; Kaplan et al. 2020, table 1):
- a block: 24 * B * T * d^2 forward for q, k, v, o and the 4d MLP, plus 4 * B * T^2 * d for the
  attention scores and their weighted sum;
- the LM head: 2 * B * T * d * V forward, often the heaviest "layer" at a large vocabulary;
- the embedding: a gather, counted as B * T * d (it moves memory, it does not multiply).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.gpt import GPTConfig


@dataclass(frozen=True)
class LayerCost:
    name: str
    flops: float  # forward + backward FLOPs for one micro-batch
    params: int


def layer_costs(cfg: GPTConfig, *, micro_batch_size: int) -> list[LayerCost]:
    """Costs of [embedding, block 0, ..., block L-1, final norm + LM head], in model order."""
    B, T, d, V = micro_batch_size, cfg.seq_len, cfg.d_model, cfg.vocab_size
    block_forward = 2 * B * T * (4 * d * d + 2 * d * cfg.mlp_width) + 4 * B * T * T * d
    block_params = 4 * (d * d + d) + 2 * d * cfg.mlp_width + cfg.mlp_width + d + 4 * d
    costs = [LayerCost("embedding", 3.0 * B * T * d, V * d + T * d)]
    costs += [LayerCost(f"layers.{i}", 3.0 * block_forward, block_params) for i in range(cfg.n_layers)]
    costs.append(LayerCost("head", 3.0 * 2 * B * T * d * V, d * V + 2 * d))
    return costs


def block_costs_with_ends(costs: list[LayerCost]) -> list[float]:
    """Fold the embedding into block 0 and the head into the last block.

    Every stage boundary falls between blocks, so stage 0 always holds the embedding with block 0 and
    the last stage the head with the last block: folding them in is exact for the partitioner.
    """
    blocks = [c.flops for c in costs[1:-1]]
    blocks[0] += costs[0].flops
    blocks[-1] += costs[-1].flops
    return blocks
