"""Multi-token prediction (DeepSeek-V3 technical report, DeepSeek-AI 2024, sec. 2.2) for every decoder family.

D modules beside the model predict, at each position i, tokens further ahead: depth k (1..D) predicts t_{i+k+1} from
the previous depth's hidden state and the embedding of t_{i+k} (the report's eq. 21-23):

    h'^k_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])     (B, T, 2d) -> (B, T, d)
    h^k    = block_k(h'^k)                                       the family's block: causal, per document
    P^k    = head(norm_k(h^k))                                   (B, T, V)

h^0 is the model's last hidden state before its final norm (the models' ``hidden``). ``Emb`` and ``head`` are the
model's own, shared: the module keeps ``embed``, a copy of the token embedding tied to it as a tied head is (a pipeline
puts the two on different stages), and calls the head it is given. The concatenation puts the embedding first, as
DeepSeek's released ``eh_proj`` weights are laid out and Megatron-LM computes it (eq. 21 writes the two the other way
round). Each depth has its own output norm ``norm``: the release stores a trained one per depth (``shared_head.norm``),
and Megatron-LM's MTP layers have their own final norm; it starts as the final norm does. The norms are the family's
(copies of its final norm: RMSNorm, GPT-2's LayerNorm), the block the one the family builds at index L + k - 1 (so
DeepSeek-V3's is a mixture-of-experts block, as the release's layer 61 is). GPT-2's learned positions enter through
h^{k-1} only.

Shapes stay (B, T, .) at every depth (Megatron-LM's layout): position i needs t_{i+k}, which the window holds only up
to i = T - 1 - k; the engine feeds a placeholder token beyond and takes no loss there, and causal attention keeps the
placeholders out of every valid position (the report's h^k_{1:T-k}). So tensor, sequence and context parallelism cut
every depth as they cut the model.

Parameter names: ``mtp.embed``, ``mtp.layers.<k-1>.{enorm, hnorm, eh_proj, block.*, norm}``. Hugging Face files name
them as DeepSeek's release does: ``<layer prefix>.<L+k-1>.{enorm, hnorm, eh_proj, shared_head.norm}`` and the block
under the family's own names for block L + k - 1; the release also stores the shared tensors again there
(``embed_tokens``, ``shared_head.head``, equal to the model's): they are read from the model's and written back from
them. ``with_multi_token_prediction`` gives a family's spec all of this (models/__init__.py applies it to every family).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import torch
from torch import nn

from models.common.norm import RMSNorm
from models.spec import MOE, SEQUENCE_LINEAR, SEQUENCE_NORM, TOKEN_EMBEDDING, VOCAB_EMBEDDING, HFAdapter, ModelSpec

MTP = "mtp"  # the model's attribute
MTP_EMBEDDING = f"{MTP}.embed"  # the token embedding's tied copy
_PARAMETER = re.compile(r"mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|block|norm)\.(.+)")
_HF_PARTS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
MTP_HF_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the release's copies of the shared tensors


def norm_like(norm: nn.Module) -> nn.Module:
    """A new norm of ``norm``'s kind and settings (the family's final norm), on the default device. (Not a deep copy:
    that reads a fake tensor's data pointer, which the cost model's FakeTensorMode build forbids.)"""
    if isinstance(norm, RMSNorm):
        return RMSNorm(norm.weight.shape[0], norm.eps)
    if isinstance(norm, nn.LayerNorm):
        return nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                            bias=norm.bias is not None)
    raise TypeError(f"multi-token prediction: no rule to make a norm like {type(norm).__name__}")


class MTPLayer(nn.Module):
    """Depth k: its two input norms, the projection, the block and its output norm."""

    def __init__(self, *, block: nn.Module, norm: nn.Module, d_model: int):
        super().__init__()
        self.enorm = norm_like(norm)
        self.hnorm = norm_like(norm)
        self.eh_proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = norm_like(norm)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        """h^{k-1} (B, T, d) and Emb(t_{i+k}) (B, T, d) -> h^k (B, T, d); ``extras``: the block's positions and
        document ids, as the model's blocks get them."""
        return self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)), *extras)


class MultiTokenPrediction(nn.Module):
    def __init__(self, layers: list[MTPLayer], embed: nn.Embedding):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleDict({str(k): layer for k, layer in enumerate(layers)})

    def forward(self, hidden: torch.Tensor, future: torch.Tensor, head: nn.Module, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> list[torch.Tensor]:
        """h^0 (B, T, d), ``future`` (B, T, D) int64: column k-1 holds t_{i+k} -> the D depths' logits, each
        (B, T, V) as ``head`` gives them. ``positions`` / ``documents``: the model's (None where it takes none)."""
        extras = tuple(t for t in (positions, documents) if t is not None)
        logits = []
        for k, layer in enumerate(self.layers.values()):
            hidden = layer(hidden, self.embed(future[..., k]), *extras)
            logits.append(head(layer.norm(hidden)))
        return logits


def mtp_depth(cfg: Any) -> int:
    """The model's depths (0 for a family whose config has no ``mtp_depth``)."""
    return getattr(cfg, "mtp_depth", 0)


def without_mtp(cfg: Any) -> Any:
    """The model alone (generation and evaluation use no MTP depth)."""
    return dataclasses.replace(cfg, mtp_depth=0) if mtp_depth(cfg) else cfg


def extended(cfg: Any) -> Any:
    """The model with D more blocks and no MTP: its blocks L..L+D-1 are the depths' (how they are built, named in
    files and initialised)."""
    return dataclasses.replace(cfg, n_layers=cfg.n_layers + mtp_depth(cfg), mtp_depth=0)


def build(family_build: Callable[..., nn.Module], cfg: Any, *, share_tied_weights: bool = True) -> nn.Module:
    """The family's model and, when ``cfg.mtp_depth`` > 0, its ``mtp`` module: built with D more blocks, whose last D
    become the depths' blocks. ``share_tied_weights=False``: ``mtp.embed`` gets a weight of its own (kept equal to
    the embedding by the caller, as a tied head's)."""
    depth = mtp_depth(cfg)
    if not depth:
        return family_build(cfg, share_tied_weights=share_tied_weights)
    model = family_build(extended(cfg), share_tied_weights=share_tied_weights)
    blocks = [model.layers.pop(str(cfg.n_layers + k)) for k in range(depth)]
    layers = [MTPLayer(block=block, norm=model.norm, d_model=cfg.d_model) for block in blocks]
    model.mtp = MultiTokenPrediction(layers, nn.Embedding(cfg.vocab_size, cfg.d_model))
    if share_tied_weights:
        model.mtp.embed.weight = getattr(model, TOKEN_EMBEDDING).weight
    return model


def mtp_block_names(module: nn.Module) -> list[str]:
    """The depths' blocks a module (a model or the last pipeline stage) holds: "mtp.layers.<k>.block"."""
    mtp = getattr(module, MTP, None)
    return [f"{MTP}.layers.{k}.block" for k in mtp.layers] if mtp is not None else []


def main_model_name(name: str, n_layers: int) -> str:
    """The model parameter whose initial-value rule an MTP parameter follows: a depth's block is block L + k, its
    norms the final norm, the embedding's copy the embedding; ``eh_proj`` keeps its own name (N(0, 0.02))."""
    if name == f"{MTP_EMBEDDING}.weight":
        return f"{TOKEN_EMBEDDING}.weight"
    match = _PARAMETER.fullmatch(name)
    if match is None:
        return name
    k, part, rest = int(match.group(1)), match.group(2), match.group(3)
    if part == "block":
        return f"layers.{n_layers + k}.{rest}"
    return f"norm.{rest}" if part.endswith("norm") else name


def mtp_model_plan(depth: int, *, sequence_parallel: bool) -> dict[str, str]:
    """The depths' tensor-parallel styles beside their blocks' (which take the family's block plan): the embedding's
    copy split over the vocabulary; under SP the norms and the projection on sequence shards."""
    if not depth:
        return {}
    plan = {MTP_EMBEDDING: VOCAB_EMBEDDING}
    if sequence_parallel:
        for k in range(depth):
            plan.update({f"{MTP}.layers.{k}.{norm}": SEQUENCE_NORM for norm in ("enorm", "hnorm", "norm")})
            plan[f"{MTP}.layers.{k}.eh_proj"] = SEQUENCE_LINEAR
    return plan


def mtp_moe_names(spec: ModelSpec, cfg: Any) -> list[str]:
    """The depths' mixture-of-experts modules ("mtp.layers.0.block.moe"), where the family's block L + k has one."""
    kinds = spec.block_kinds(extended(cfg))[cfg.n_layers:]
    return [f"{MTP}.layers.{k}.block.moe" for k, kind in enumerate(kinds) if kind == MOE]


def mtp_hf_prefix(hf: HFAdapter, cfg: Any, k: int) -> str:
    """Where depth k's tensors live in Hugging Face files ("model.layers.61"), through ``hf``'s names."""
    (name,), _ = hf.from_hf(f"{MTP}.layers.{k}.eh_proj.weight", cfg)
    return name.removesuffix(".eh_proj.weight")


def with_multi_token_prediction(spec: ModelSpec) -> ModelSpec:
    """``spec`` whose models carry their MTP depths: built, initialised, counted in FLOPs and named in Hugging Face
    files by the rules above (the family's own functions for everything of the model itself)."""
    family_build = spec.build
    return dataclasses.replace(
        spec, build=functools.partial(build, family_build),
        initial_value=functools.partial(_initial_value, spec.initial_value),
        flops_per_token=functools.partial(_flops_per_token, spec.flops_per_token),
        hf=dataclasses.replace(
            spec.hf, to_hf=functools.partial(_to_hf, spec.hf, family_build),
            from_hf=functools.partial(_from_hf, spec.hf, family_build),
            config_to_hf=functools.partial(_config_to_hf, spec.hf.config_to_hf),
            config_from_hf=functools.partial(_config_from_hf, spec.hf.config_from_hf)))


def _initial_value(family: Callable[..., torch.Tensor], name: str, shape: tuple[int, ...], *, seed: int,
                   cfg: Any) -> torch.Tensor:
    return family(main_model_name(name, cfg.n_layers), shape, seed=seed, cfg=cfg)


def _flops_per_token(family: Callable[[Any], float], cfg: Any) -> float:
    """The model's, plus each depth's block (the extended model's extra blocks), projection and head: 6 per
    parameter per token (DeepSeek-V3 counts its MTP module in training compute the same way)."""
    depth = mtp_depth(cfg)
    if not depth:
        return family(cfg)
    main = dataclasses.replace(cfg, mtp_depth=0)
    blocks = family(extended(cfg)) - family(main)
    return family(main) + blocks + depth * 6.0 * (2 * cfg.d_model * cfg.d_model + cfg.d_model * cfg.vocab_size)


@functools.lru_cache(maxsize=64)
def _block_parameter(family_build: Callable[..., nn.Module], cfg: Any, index: int) -> str:
    """The name of a parameter of block ``index`` of ``cfg``'s model (built on the meta device)."""
    with torch.device("meta"):
        block = family_build(cfg).layers[str(index)]
    return f"layers.{index}.{next(name for name, _ in block.named_parameters())}"


def _family_prefix(hf: HFAdapter, family_build: Callable[..., nn.Module], cfg: Any, k: int) -> str:
    ext, index = extended(cfg), cfg.n_layers + k
    theirs = hf.from_hf(_block_parameter(family_build, ext, index), ext)[0][0]
    return theirs[:theirs.index(f".{index}.") + len(f".{index}")]


def _to_hf(hf: HFAdapter, family_build: Callable[..., nn.Module], state: dict[str, torch.Tensor],
           cfg: Any) -> dict[str, torch.Tensor]:
    depth = mtp_depth(cfg)
    if not depth:
        return hf.to_hf(state, cfg)
    model, parts = {}, {}
    for name, tensor in state.items():
        match = _PARAMETER.fullmatch(name)
        if name == f"{MTP_EMBEDDING}.weight":
            continue  # the embedding's copy: the embedding is written
        if match is None:
            model[name] = tensor
        elif match.group(2) == "block":
            model[f"layers.{cfg.n_layers + int(match.group(1))}.{match.group(3)}"] = tensor
        else:
            parts[name] = tensor
    out = hf.to_hf(model, extended(cfg))
    embedding = state[f"{TOKEN_EMBEDDING}.weight"]
    for k in range(depth):
        prefix = _family_prefix(hf, family_build, cfg, k)
        for name, tensor in parts.items():
            match = _PARAMETER.fullmatch(name)
            if int(match.group(1)) == k:
                out[f"{prefix}.{_HF_PARTS[match.group(2)]}.{match.group(3)}"] = tensor.contiguous()
        out[f"{prefix}.embed_tokens.weight"] = embedding
        out[f"{prefix}.shared_head.head.weight"] = state.get("head.weight", embedding)
    return out


def _from_hf(hf: HFAdapter, family_build: Callable[..., nn.Module], name: str,
             cfg: Any) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]]:
    if name == f"{MTP_EMBEDDING}.weight":
        return hf.from_hf(f"{TOKEN_EMBEDDING}.weight", cfg)
    match = _PARAMETER.fullmatch(name) if mtp_depth(cfg) else None
    if match is None:
        return hf.from_hf(name, cfg)
    k, part, rest = int(match.group(1)), match.group(2), match.group(3)
    if part == "block":
        return hf.from_hf(f"layers.{cfg.n_layers + k}.{rest}", extended(cfg))
    return (f"{_family_prefix(hf, family_build, cfg, k)}.{_HF_PARTS[part]}.{rest}",), _same


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _config_to_hf(family: Callable[[Any], dict], cfg: Any) -> dict:
    """config.json's ``num_nextn_predict_layers`` (DeepSeek-V3's key) says how many depths the files hold."""
    config = family(cfg)
    return {**config, "num_nextn_predict_layers": mtp_depth(cfg)} if mtp_depth(cfg) else config


def _config_from_hf(family: Callable[[dict], Any], config: dict) -> Any:
    cfg = family(config)
    depth = int(config.get("num_nextn_predict_layers") or 0)
    return dataclasses.replace(cfg, mtp_depth=depth) if hasattr(cfg, "mtp_depth") else cfg
