"""Model FLOPs per token: the numerator of MFU and of the planner's throughput.

Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; the same count as Megatron-LM's
Narayanan et al. 2021, sec. 5.1, without recomputation): 6 * N + 12 * L * T * d, where N is the
number of parameters that take part in matrix products (blocks and LM head, not the embedding
lookups), L the layers, T the sequence length and d the width. The second term is attention:
Q K^T and attention x V, forward and backward. Activation recomputation is not counted: MFU
measures useful model work, not work done.
"""

from __future__ import annotations

from models.gpt import GPTConfig


def matmul_params(cfg: GPTConfig) -> int:
    d, f, V = cfg.d_model, cfg.mlp_width, cfg.vocab_size
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d  # attention, MLP, two layer norms
    return cfg.n_layers * block + 2 * d + d * V  # + final norm + head


def training_flops_per_token(cfg: GPTConfig) -> float:
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.seq_len * cfg.d_model
