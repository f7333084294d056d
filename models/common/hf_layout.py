"""The Hugging Face tensor names of the shared decoder (decoder.py), for the families' adapters.

``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and
``DeepseekV3ForCausalLM`` store ``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.*,
post_attention_layernorm}``, ``model.norm`` and ``lm_head`` (absent when tied); the attention is
``self_attn.{q,k,v,o}_proj`` (Qwen3 adds ``self_attn.{q,k}_norm``) unless a family names its own (DeepSeek-V3's
latent attention: models/deepseek_v3/hf.py). Both sides keep ``nn.Linear`` weights [out, in], so the map is names
only: no transposes, no permutations.

Feed-forward parts: a dense block's ``mlp.{gate,up,down}_proj``; a mixture's router ``<moe>.gate`` (DeepSeek-V3's
selection bias ``<moe>.gate.e_score_correction_bias``), its shared experts ``<moe>.shared_experts.{gate,up,down}_proj``
and its routed experts, one tensor per expert in the files (``<moe>.experts.N.{gate_proj,up_proj,down_proj}``;
Mixtral: ``block_sparse_moe.experts.N.{w1,w3,w2}``) but stacked in the engine (``moe.experts.{w1,w3,w2}``, dim 0
the expert). ``to_hf`` splits a stack into its E rows; ``from_hf`` names the E tensors of a stack in expert order
and stacks them. A reader that holds only experts a..b-1 of a layer (expert parallelism) can read
``names[a:b]`` alone and stack those: row e of the stack is the e-th name (the families' ``HFAdapter.stacked``;
runtime/checkpoint/hf_weights.py reads so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from models.spec import DENSE, MOE

GQA_ATTENTION = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
                 "attn.o": "self_attn.o_proj"}
_QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_DENSE_MLP = {"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
_SHARED = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
STACKED = ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2")  # ours; in this order in MoELayout.experts
TOKEN_EMBEDDING, HEAD, HF_HEAD = "tok_emb.weight", "head.weight", "lm_head.weight"


@dataclass(frozen=True)
class MoELayout:
    """Where a family's Hugging Face files keep a mixture's tensors."""

    prefix: str  # the feed-forward module: "mlp" (Qwen3-MoE, DeepSeek-V3), "block_sparse_moe" (Mixtral)
    experts: tuple[str, str, str]  # each expert's gate, up and down names (our w1, w3, w2)


QWEN3_MOE = MoELayout(prefix="mlp", experts=("gate_proj", "up_proj", "down_proj"))
MIXTRAL = MoELayout(prefix="block_sparse_moe", experts=("w1", "w3", "w2"))


def hf_names(*, kinds: tuple[str, ...], tie_embeddings: bool, qk_norm: bool = False, moe: MoELayout | None = None,
             n_experts: int = 0, shared_experts: bool = False, expert_bias: bool = False,
             attention: Mapping[str, str] = GQA_ATTENTION) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the Hugging Face tensors it is made of (one; or E, stacked), the head included (the
    embedding's name when tied). ``kinds``: each block's kind (moe.py ``block_kinds``); ``attention``: our attention
    module names (block-relative) -> theirs, each a weight."""
    names = {TOKEN_EMBEDDING: ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",)}
    for i, kind in enumerate(kinds):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        block = {"attn_norm": "input_layernorm", **attention, "mlp_norm": "post_attention_layernorm",
                 **(_QK_NORMS if qk_norm else {}), **(_DENSE_MLP if kind == DENSE else {})}
        names.update({f"{ours}.{o}.weight": (f"{theirs}.{h}.weight",) for o, h in block.items()})
        if kind != MOE:
            continue
        hf = f"{theirs}.{moe.prefix}"
        names[f"{ours}.moe.router.gate.weight"] = (f"{hf}.gate.weight",)
        if expert_bias:
            names[f"{ours}.moe.router.expert_bias"] = (f"{hf}.gate.e_score_correction_bias",)
        for stacked, expert in zip(STACKED, moe.experts):
            names[f"{ours}.{stacked}"] = tuple(f"{hf}.experts.{e}.{expert}.weight" for e in range(n_experts))
        if shared_experts:
            names.update({f"{ours}.moe.shared_experts.{o}.weight": (f"{hf}.shared_experts.{h}.weight",)
                          for o, h in _SHARED.items()})
    names[HEAD] = names[TOKEN_EMBEDDING] if tie_embeddings else (HF_HEAD,)
    return names


def is_stacked(name: str) -> bool:
    return name.endswith(STACKED)


def to_hf(state: Mapping[str, torch.Tensor], names: Mapping[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Our state dict (a tied head may be listed or not) -> the Hugging Face one; a stack becomes E tensors."""
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        if ours == HEAD and theirs == names[TOKEN_EMBEDDING]:
            continue  # tied: Hugging Face saves the embedding only
        if is_stacked(ours):
            out.update({name: state[ours][e] for e, name in enumerate(theirs)})
        else:
            out[theirs[0]] = state[ours]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(name: str, names: Mapping[str, tuple[str, ...]], *,
            family: str) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    """The Hugging Face tensors our parameter ``name`` is made of, and how: as it is, or the experts stacked."""
    theirs = names.get(name)
    if theirs is None:
        raise KeyError(f"{name} is not a parameter of the {family} model")
    return theirs, (_stack if is_stacked(name) else _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _stack(*experts: torch.Tensor) -> torch.Tensor:
    return torch.stack(experts)  # (E, ...): row e is expert e
