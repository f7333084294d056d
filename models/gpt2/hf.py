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

from typing import Callable

import torch

from models.gpt2.model import GPT2_MLP_RATIO, GPTConfig

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


def to_hf(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> a ``GPT2LMHeadModel`` state dict (contiguous tensors). A tied model has no
    ``lm_head.weight`` (Hugging Face ties it to ``wte`` on loading and does not save it)."""
    out = {hf: state[ours] for ours, hf in _TOP.items()}
    for ours, hf, transposed, qkv in _block_tensors(cfg):
        t = _qkv_to_hf(state[ours], cfg.n_heads) if qkv else state[ours]
        out[hf] = t.t() if transposed else t
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(name: str, cfg: GPTConfig) -> tuple[tuple[str, ...], Callable[[torch.Tensor], torch.Tensor]]:
    """The ``GPT2LMHeadModel`` tensors our parameter ``name`` is made of, and how (the inverse of ``to_hf``)."""
    for ours, hf in _TOP.items():
        if name == ours:
            return (hf,), _same
    if name == "head.weight":  # a tied model's head is wte; Hugging Face omits lm_head.weight then
        return ("transformer.wte.weight" if cfg.tie_embeddings else "lm_head.weight",), _same
    for ours, hf, transposed, qkv in _block_tensors(cfg):
        if name == ours:
            return (hf,), lambda t: _from_conv1d(t, transposed=transposed, qkv=qkv, n_heads=cfg.n_heads)
    raise KeyError(f"{name} is not a parameter of the GPT-2 model")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _from_conv1d(t: torch.Tensor, *, transposed: bool, qkv: bool, n_heads: int) -> torch.Tensor:
    t = t.t() if transposed else t
    return (_qkv_from_hf(t, n_heads) if qkv else t).contiguous()


def config_to_hf(cfg: GPTConfig) -> dict:
    """``config.json`` for ``GPT2LMHeadModel.from_pretrained``: our model has no dropout, GELU's tanh
    approximation ("gelu_new") and LayerNorm eps 1e-5."""
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions, "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.mlp_width,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_pdrop": 0.0,
        "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }
    if cfg.vocab_size == 50257:  # GPT-2's BPE: <|endoftext|> is both
        config.update(bos_token_id=50256, eos_token_id=50256)
    return config


# Our model: GELU's tanh approximation, LayerNorm eps 1e-5, no dropout, attention scaled by 1/sqrt(hd).
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


def config_from_hf(config: dict) -> GPTConfig:
    """A GPT-2 ``config.json`` -> our config; ValueError naming the key for what our model does not compute."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation_function {activation!r}: this GPT-2 computes GELU's tanh approximation "
                         f"({' or '.join(_ACTIVATIONS)})")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if abs(eps - 1e-5) > 1e-12:
        raise ValueError(f"layer_norm_epsilon {eps}: this GPT-2's layer norms use 1e-5")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(key):
            raise ValueError(f"{key} true: not computed by this GPT-2")
    try:
        d = int(config["n_embd"])
        context = int(config.get("n_positions", config.get("n_ctx", 1024)))
        return GPTConfig(n_layers=int(config["n_layer"]), d_model=d, n_heads=int(config["n_head"]),
                         seq_len=context, n_positions=context,  # the window defaults to the whole context
                         vocab_size=int(config["vocab_size"]),
                         mlp_width=int(config.get("n_inner") or GPT2_MLP_RATIO * d),
                         tie_embeddings=bool(config.get("tie_word_embeddings", True)))
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
