"""LoRA adapters as peft stores them (``PeftModel.save_pretrained``; its layout read from the files it writes, the
fixture tests/fixtures/peft/llama3-lora): a folder with

    adapter_config.json         peft's ``LoraConfig`` as JSON: r, lora_alpha, lora_dropout, target_modules, ...
    adapter_model.safetensors   base_model.model.<the Hugging Face module>.lora_A.weight [r, in] and .lora_B.weight
                                [out, r] per adapted module (peft's adapter name, "default", left out)

``read_adapter`` turns one into a ``LoraConfig`` and our adapters' values (``--lora-from``); ``write_adapter``
writes ours (``run.py export --format peft``), which peft loads onto the run's source folder.

Our names map to peft's through the family's Hugging Face adapter (models/<family>/hf.py): a linear layer's weight
is one Hugging Face tensor ``<module>.weight``, whose features may be ordered otherwise (GPT-2's fused q/k/v
regrouped by heads) or transposed (GPT-2's Conv1D, stored [in, out]: peft's ``fan_in_fan_out``). ``from_hf``'s
combination is probed with index tensors to find both feature orders, and B's rows and A's columns are put in
Hugging Face's order; a combination that is not a reordering of features is refused. A mixture's stacked experts
are one Hugging Face module per expert (``...experts.<e>.gate_proj``), each with its own adapter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compiler.lora import LoraConfig
from compiler.lora.config import EXPERTS, model_targets
from compiler.lora.modules import EXPERT_MATRICES
from models import parameter_shapes, spec_of
from runtime.checkpoint.safetensors import TensorFileError, load_file, save_file, write_json

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the *ForCausalLM model
PEFT_LAYOUT = "0.21.2"  # the peft version whose files these follow (the fixture's)
# peft options that change what an adapter computes, which this engine does not: each must be off (false, null, {})
_UNSUPPORTED = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters",
                "layers_to_transform", "layers_pattern", "exclude_modules", "lora_bias", "layer_replication",
                "trainable_token_indices", "use_qalora", "alora_invocation_tokens")


@dataclass(frozen=True)
class Adapted:
    """One adapted matrix of ours (a linear's weight, or one of the experts' stacked matrices) and peft's modules."""

    kind: str  # its target (compiler/lora/config.py)
    adapters: tuple[str, str]  # our A's and B's names
    modules: tuple[str, ...]  # the Hugging Face modules, one per expert for stacked experts
    out_order: torch.Tensor  # our output feature i is Hugging Face's out_order[i]
    in_order: torch.Tensor
    transposed: bool  # Hugging Face stores the weight [in, out] (Conv1D)


def adapted_matrices(model_cfg: Any) -> list[Adapted]:
    """Every matrix of the model LoRA can adapt, with its peft modules and feature orders."""
    spec = spec_of(model_cfg)
    with torch.device("meta"):
        meta = {n: torch.empty(s) for n, s in parameter_shapes(model_cfg).items()}
        hf_shapes = {n: tuple(t.shape) for n, t in spec.hf.to_hf(meta, model_cfg).items()}
        targets = model_targets(spec.build(model_cfg))
    found, probed = [], {}  # probes by block-relative name and shapes: every block's combination is alike
    for kind, modules in targets.items():
        for module in modules:
            matrices = [(f"{module}.{m}", (f"{module}.{m}_lora_A", f"{module}.{m}_lora_B")) for m in EXPERT_MATRICES] \
                if kind == EXPERTS else [(f"{module}.weight", (f"{module}.lora_A.weight", f"{module}.lora_B.weight"))]
            for weight, adapters in matrices:
                hf_names, combine = spec.hf.from_hf(weight, model_cfg)
                if not all(n.endswith(".weight") for n in hf_names):
                    raise ValueError(f"{weight}: Hugging Face keeps it as {', '.join(hf_names)}, not module weights")
                shapes = [hf_shapes[n] for n in hf_names]
                key = (re.sub(r"^layers\.\d+\.", "", weight), tuple(shapes))
                if key not in probed:
                    probed[key] = _feature_orders(weight, combine, shapes)
                out_order, in_order, transposed = probed[key]
                found.append(Adapted(kind, adapters, tuple(n.removesuffix(".weight") for n in hf_names),
                                     out_order, in_order, transposed))
    return found


def _feature_orders(weight: str, combine, shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Probe ``combine`` (Hugging Face tensors -> our weight) with tensors holding each element's (row, column) index,
    row x columns + column: (our output feature -> theirs, our input feature -> theirs, whether theirs is [in, out]);
    ValueError if it combines features other than by reordering them."""
    probe = combine(*(torch.arange(s[0] * s[1], dtype=torch.int64).view(s) for s in shapes))
    orders = set()
    for index, shape in zip(probe.reshape(-1, *probe.shape[-2:]), shapes):  # each expert's
        r, c = index // shape[1], index % shape[1]
        if (r == r[:, :1]).all() and (c == c[:1]).all():
            order = (r[:, 0], c[0], False)
        elif (c == c[:, :1]).all() and (r == r[:1]).all():
            order = (c[:, 0], r[0], True)
        else:
            raise ValueError(f"{weight}: its Hugging Face tensor's features are combined, not reordered")
        if any(not torch.equal(o.sort().values, torch.arange(len(o))) for o in order[:2]):
            raise ValueError(f"{weight}: its Hugging Face tensor holds other features than ours")
        orders.add((tuple(order[0].tolist()), tuple(order[1].tolist()), order[2]))
    if len(orders) != 1:
        raise ValueError(f"{weight}: its stacked Hugging Face tensors differ in feature order")
    (out_order, in_order, transposed), = orders
    return torch.tensor(out_order), torch.tensor(in_order), transposed


def _tensor_names(module: str) -> tuple[str, str]:
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


def write_adapter(folder: str | Path, adapters: dict[str, torch.Tensor], *, model_cfg: Any, lora: LoraConfig,
                  base_model: str | None) -> list[str]:
    """Our adapters (full tensors by name) as a peft folder for ``base_model`` (the run's source folder); returns the
    files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    matrices = adapted_matrices(model_cfg)
    used = [m for m in matrices if m.kind in lora.targets]
    tensors = {}
    for m in used:
        a, b = (adapters[n].float().contiguous() for n in m.adapters)
        a, b = a[..., m.in_order.argsort()], b[..., m.out_order.argsort(), :]  # features in Hugging Face's order
        for e, module in enumerate(m.modules):
            a_name, b_name = _tensor_names(module)
            tensors[a_name], tensors[b_name] = (a[e], b[e]) if a.ndim == 3 else (a, b)
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    every = {module for m in matrices for module in m.modules}
    write_json(folder / ADAPTER_CONFIG, _config_json(lora, _target_modules({x for m in used for x in m.modules}, every),
                                                     base_model=base_model, transposed=any(m.transposed for m in used)))
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def _target_modules(adapted: set[str], every: set[str]) -> list[str]:
    """peft's ``target_modules``: the modules' last names where they pick exactly the adapted ones (peft matches
    a name or a ``.name`` suffix), else the modules' full names."""
    suffixes = {m.rsplit(".", 1)[-1] for m in adapted}
    picked = {m for m in every if m.rsplit(".", 1)[-1] in suffixes}
    return sorted(suffixes) if picked == adapted else sorted(adapted)


def _config_json(lora: LoraConfig, target_modules: list[str], *, base_model: str | None, transposed: bool) -> dict:
    """adapter_config.json with every key peft 0.21 writes, ours set, the rest at peft's defaults."""
    off = dict.fromkeys(("alora_invocation_tokens", "arrow_config", "auto_mapping", "corda_config", "eva_config",
                         "exclude_modules", "kasa_config", "layer_replication", "layers_pattern", "layers_to_transform",
                         "lora_ga_config", "megatron_config", "modules_to_save", "monteclora_config", "revision",
                         "target_parameters", "trainable_token_indices", "use_bdlora", "velora_config"))
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {**off, "alpha_pattern": {}, "base_model_name_or_path": base_model, "bias": "none",
            "ensure_weight_tying": False, "fan_in_fan_out": transposed, "inference_mode": True,
            "init_lora_weights": True, "loftq_config": {}, "lora_alpha": alpha, "lora_bias": False,
            "lora_dropout": lora.dropout, "megatron_core": "megatron.core", "peft_type": "LORA",
            "peft_version": PEFT_LAYOUT, "qalora_group_size": 16, "r": lora.rank, "rank_pattern": {},
            "target_modules": target_modules, "task_type": "CAUSAL_LM", "use_dora": False, "use_qalora": False,
            "use_rslora": False}


def read_adapter(folder: str | Path, model_cfg: Any) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A peft LoRA folder for a model of ``model_cfg``: its settings and our adapters' full values by name.
    TensorFileError naming the file and what does not fit."""
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise TensorFileError(f"{path}: missing (a peft adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise TensorFileError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise TensorFileError(f"{config_path}: a JSON {type(config).__name__}, not peft's LoraConfig object")
    if config.get("peft_type", "LORA") != "LORA":
        raise TensorFileError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters are read")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise TensorFileError(f"{config_path}: {key} {config[key]!r} is not supported (leave it unset)")
    if config.get("bias", "none") != "none":
        raise TensorFileError(f"{config_path}: bias {config['bias']!r} is not supported (none)")
    matrices = adapted_matrices(model_cfg)
    chosen = [m for m in matrices if all(_matches(config.get("target_modules"), x) for x in m.modules)]
    partly = [m for m in matrices if m not in chosen and any(_matches(config.get("target_modules"), x) for x in m.modules)]
    targets = tuple(dict.fromkeys(m.kind for m in chosen))
    if not chosen or partly or any(m.kind in targets and m not in chosen for m in matrices):
        raise TensorFileError(f"{config_path}: target_modules {config.get('target_modules')!r} picks no whole set of "
                              f"this {model_cfg.family} model's modules (each of its targets in every block)")
    lora = LoraConfig(rank=_setting(config, "r", config_path, integer=True),
                      alpha=_setting(config, "lora_alpha", config_path), targets=targets,
                      dropout=_setting(config, "lora_dropout", config_path, default=0.0), init_from=str(folder))
    return lora, _read_values(weights_path, chosen, rank=lora.rank)


def _setting(config: dict, key: str, path: Path, *, integer: bool = False, default: float | None = None) -> float:
    """A number peft's LoraConfig keeps (r, lora_alpha, lora_dropout); TensorFileError naming ``path`` and ``key``
    where it is absent (without a ``default``) or not a number of that kind."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise TensorFileError(f"{path}: no {key!r} (peft's LoraConfig writes r, lora_alpha and target_modules)")
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TensorFileError(f"{path}: {key} {value!r} must be {'an integer' if integer else 'a number'}")
    return value if integer else float(value)


def _matches(target_modules: str | list[str] | None, module: str) -> bool:
    """peft's ``check_target_module_exists``: a string is a regular expression the whole name matches; a list
    names modules by their name or a dotted suffix of it."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules or ())


def _read_values(path: Path, matrices: list[Adapted], *, rank: int) -> dict[str, torch.Tensor]:
    stored = load_file(path)
    values = {}
    for m in matrices:
        pairs = []
        for module in m.modules:
            names = _tensor_names(module)
            missing = [n for n in names if n not in stored]
            if missing:
                raise TensorFileError(f"{path}: no tensor {missing[0]!r}")
            a, b = (stored[n].float() for n in names)
            if a.shape != (rank, len(m.in_order)) or b.shape != (len(m.out_order), rank):
                raise TensorFileError(f"{path}: {names[0]} {list(a.shape)} and {names[1]} {list(b.shape)} do not fit "
                                      f"r {rank} on a [{len(m.out_order)}, {len(m.in_order)}] weight")
            pairs.append((a[:, m.in_order], b[m.out_order]))
        a, b = zip(*pairs)
        values[m.adapters[0]], values[m.adapters[1]] = (torch.stack(a), torch.stack(b)) if m.kind == EXPERTS else (a[0], b[0])
    return values
