"""Our GPT's weights in Hugging Face's GPT-2 layout (``GPT2LMHeadModel``), and back: the interchange
format for trained weights, written with torch and json only.

Layout differences:
- names: ``tok_emb`` -> ``transformer.wte``, ``layers.i.attn.qkv`` -> ``transformer.h.i.attn.c_attn``, ...;
- the four block matrices are ``Conv1D`` in GPT-2, stored [in, out]: the transpose of ``nn.Linear``;
- the fused q/k/v output features: ours are grouped per head, [q_h, k_h, v_h] for h = 0..H-1 (so a
  tensor-parallel shard holds whole heads); GPT-2's are [Q | K | V], each head-major;
- the LM head is tied to ``wte``; an untied model adds ``lm_head.weight`` and says so in the config.
"""

from __future__ import annotations

import torch

from models.gpt import GPTConfig

_BLOCK = {  # ours (in layers.i) -> GPT-2 (in transformer.h.i), and whether the weight is a Conv1D
    "ln1": ("ln_1", False), "attn.qkv": ("attn.c_attn", True), "attn.o": ("attn.c_proj", True),
    "ln2": ("ln_2", False), "mlp.up": ("mlp.c_fc", True), "mlp.down": ("mlp.c_proj", True),
}
_TOP = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}


def _qkv_to_hf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Output features (dim 0) from per-head [q_h, k_h, v_h] to [Q | K | V]: (H, 3, hd, ...) -> (3, H, hd, ...)."""
    return t.reshape(n_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_hf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t.reshape(3, n_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _block_tensors(cfg: GPTConfig):
    """(our name, Hugging Face name, stored transposed (Conv1D weight), fused q/k/v) of every block tensor."""
    for i in range(cfg.n_layers):
        for ours, (hf, conv1d) in _BLOCK.items():
            for kind in ("weight", "bias"):
                yield (f"layers.{i}.{ours}.{kind}", f"transformer.h.{i}.{hf}.{kind}", conv1d and kind == "weight",
                       ours == "attn.qkv")


def to_hf_gpt2(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> a ``GPT2LMHeadModel`` state dict (contiguous tensors)."""
    out = {hf: state[ours] for ours, hf in _TOP.items()}
    for ours, hf, transposed, qkv in _block_tensors(cfg):
        t = _qkv_to_hf(state[ours], cfg.n_heads) if qkv else state[ours]
        out[hf] = t.t() if transposed else t
    out["lm_head.weight"] = state["tok_emb.weight" if cfg.tie_embeddings else "head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_gpt2(hf: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict -> ours (the inverse of ``to_hf_gpt2``)."""
    out = {ours: hf[name] for ours, name in _TOP.items()}
    for ours, name, transposed, qkv in _block_tensors(cfg):
        t = hf[name].t() if transposed else hf[name]
        out[ours] = _qkv_from_hf(t, cfg.n_heads) if qkv else t
    out["head.weight"] = hf.get("lm_head.weight", hf["transformer.wte.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: GPTConfig) -> dict:
    """``config.json`` for ``GPT2LMHeadModel.from_pretrained``: our model has no dropout, GELU's tanh
    approximation ("gelu_new") and LayerNorm eps 1e-5."""
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len, "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.mlp_width,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_pdrop": 0.0,
        "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }
    if cfg.vocab_size == 50257:  # GPT-2's BPE: <|endoftext|> is both
        config.update(bos_token_id=50256, eos_token_id=50256)
    return config
