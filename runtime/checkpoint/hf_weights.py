"""A Hugging Face model folder as a run's starting point (``--init-from FOLDER``), as generate's model, and as
the source of what an export of the trained model carries beyond its weights (``carried_from``).

The folder's ``config.json`` names the family (``architectures``, else ``model_type``, against each
family's Hugging Face adapter, models/spec.py) and the shape (the family's ``config_from_hf``), so no
``--model`` or shape flag is needed. Shape flags may be given if they agree; ``--seq-len`` sets the training
window, at most the folder's context, which the model keeps whole (GPT-2's position table keeps every row,
so an export after training has every tensor of the folder's shape).

Everything is checked before any process group exists, from the headers alone (``check_weights``): each
tensor our parameters are made of (``to_hf`` applied to meta tensors of our parameter shapes gives their
Hugging Face names and shapes) must be there, with that shape and a floating-point dtype. A folder saved
from the base model (``GPT2Model``, ``LlamaModel``: names without ``transformer.`` / ``model.``) reads too;
tensors the model does not use (GPT-2's old ``attn.bias`` masks, a tied model's saved ``lm_head``) are
passed over with a note.

A folder whose config.json has a ``quantization_config`` (DeepSeek-V3's block FP8, gpt-oss's MXFP4) is opened
through runtime/checkpoint/quantized/folder.py: it shows the names, shapes and float32 values of the unquantized
folder (dequantized as each tensor is read), so the checks and the families' ``from_hf`` are the same for both.

``initial_values`` is the engine's source of starting values: for one of our parameters it reads the
Hugging Face tensors ``from_hf`` names (memory-mapped: only pages touched are read) and combines them
(transposes, q/k/v regrouping); materialising a shard then copies just that shard, in fp32. So a rank
reads only the tensors of its own stages and holds at most one full tensor beyond its shards at a time.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from models import FAMILIES, MTP, MTP_HF_COPIES, ModelSpec, mtp_depth, mtp_hf_prefix, named_config, parameter_shapes, with_window
from runtime.checkpoint.hf_folder import CONFIG_FILE, HFFolder, read_config
from runtime.checkpoint.quantized.folder import QuantizedFolder, open_folder
from runtime.checkpoint.safetensors import TensorFileError
from runtime.config import SHAPE_FLAGS, ConfigError

# What ``run.py export`` takes from the folder a run started from, beyond the weights: files copied as they
# are, and config.json keys the model does not compute (an Instruct model's eos list [128001, 128009], say).
# Without a source folder the family's defaults stand (its config_to_hf). Tokenizer files join CARRIED_FILES.
CARRIED_FILES = ("generation_config.json",)
CARRIED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

_SHOWN = 3  # unused tensor names listed in a note


@dataclass(frozen=True)
class HFModel:
    path: Path
    spec: ModelSpec
    config: Any  # the model its config.json describes; seq_len: the family's default training window


def read_hf_model(path: str | Path, *, mtp_depth: int | None = None) -> HFModel:
    """The family and model config of a Hugging Face folder (reads config.json only); ``mtp_depth``: the MTP depths
    to build and read (None: the folder's ``num_nextn_predict_layers``; 0 for generation and evaluation)."""
    path = Path(path)
    config = read_config(path)
    spec = family_of(config, path / CONFIG_FILE)
    try:
        cfg = spec.hf.config_from_hf(config)
    except ValueError as e:
        raise TensorFileError(f"{path / CONFIG_FILE}: {e}") from None
    if mtp_depth is not None and mtp_depth != getattr(cfg, "mtp_depth", 0):
        cfg = dataclasses.replace(cfg, mtp_depth=mtp_depth)
    return HFModel(path=path, spec=spec, config=cfg)


def family_of(config: dict, where: Path) -> ModelSpec:
    """The family whose adapter reads ``architectures`` (or, when a config lists none, ``model_type``)."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    for spec in FAMILIES.values():
        if (set(architectures) & set(spec.hf.architectures)) if architectures else model_type in spec.hf.model_types:
            return spec
    known = "; ".join(f"{', '.join(s.hf.architectures)} (model_type {', '.join(s.hf.model_types)})"
                      for s in FAMILIES.values())
    what = f"architectures {architectures}" if architectures else f"model_type {model_type!r}"
    raise TensorFileError(f"{where}: {what} is not a model this engine reads (it reads {known})")


def position_limit(cfg: Any) -> int:
    """Positions a model can take: its context (GPT-2's learned table's rows, Llama's published context)."""
    return cfg.context


def run_model_config(hf: HFModel, *, model_name: str | None, overrides: Mapping[str, int | None],
                     untie: bool) -> Any:
    """The folder's model with the shape flags given: each must agree with the folder, except ``--seq-len``, the
    training window, which may be up to the folder's context and leaves the model's shapes as they are.
    ``overrides``: config field -> flag value (None: not given)."""
    cfg, where = hf.config, hf.path / CONFIG_FILE
    if model_name is not None:  # with the shape flags, as without a folder
        try:
            named = named_config(model_name, **{k: v for k, v in overrides.items() if k != "seq_len"})
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if named.family != cfg.family:
            raise ConfigError(f"--model {model_name} is a {named.family} model; --init-from {hf.path} holds a "
                              f"{cfg.family} model (its {CONFIG_FILE} sets the model: drop --model)")
        differ = [f"{field} {getattr(cfg, field)} there, {getattr(named, field)} in --model {model_name}"
                  for field in (*SHAPE_FLAGS, "tie_embeddings") if field != "seq_len"
                  and getattr(named, field) != getattr(cfg, field)]
        if differ:
            raise ConfigError(f"--model {model_name} does not fit --init-from {hf.path} ({'; '.join(differ)}); "
                              f"drop --model: {where} sets the model")
    for field, value in overrides.items():
        if value is None or field == "seq_len" or value == getattr(cfg, field):
            continue
        raise ConfigError(f"{SHAPE_FLAGS[field]} {value}: --init-from {hf.path} has {field} {getattr(cfg, field)} "
                          f"({where} sets the shape; drop {SHAPE_FLAGS[field]})")
    if untie and cfg.tie_embeddings:
        raise ConfigError(f"--untie-embeddings: --init-from {hf.path} ties its embeddings (no lm_head to start "
                          f"the head from); drop --untie-embeddings")
    seq_len = overrides.get("seq_len")
    if seq_len is None or seq_len == cfg.seq_len:
        return cfg
    if seq_len > position_limit(cfg):
        raise ConfigError(f"--seq-len {seq_len}: --init-from {hf.path} has {position_limit(cfg)} positions "
                          f"({where}); valid --seq-len values: 1 to {position_limit(cfg)}")
    return with_window(cfg, seq_len)


def run_name(path: str | Path) -> str:
    """A name for the run's log folder: the model folder's, in safe characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).resolve().name) or "hf"


@dataclass(frozen=True)
class HFWeights:
    """A folder whose tensors were checked against a model: ``names`` maps each Hugging Face name the model
    needs (``to_hf``'s) to the folder's own name for it; ``fresh``: the MTP depths the folder holds none of, which
    start from name-seeded values."""

    model: HFModel
    folder: HFFolder | QuantizedFolder  # a quantized folder shows its logical float32 tensors
    names: dict[str, str]
    unused: tuple[str, ...]  # tensors of the folder no parameter is made of
    fresh: tuple[int, ...] = ()  # MTP depths (0-based) absent from the folder

    def note(self) -> str | None:
        lines = []
        if self.fresh:
            lines.append(f"--init-from {self.model.path}: no tensors of multi-token-prediction depth(s) "
                         f"{', '.join(str(k + 1) for k in self.fresh)} in the folder (transformers' saves drop them): "
                         f"they start from fresh values")
        if self.unused:
            shown = ", ".join(self.unused[:_SHOWN]) + (", ..." if len(self.unused) > _SHOWN else "")
            lines.append(f"--init-from {self.model.path}: passing over {len(self.unused)} tensors the model does not "
                         f"use ({shown})")
        return "\n".join(lines) or None


def check_weights(hf: HFModel) -> HFWeights:
    """Open the folder (headers only) and check every tensor the model needs: present, of the shape
    ``to_hf`` gives for our parameter shapes, floating point. TensorFileError naming the file and tensor.
    An MTP depth is read whole or not at all (``mtp_tensors``)."""
    folder = open_folder(hf.path)
    meta = {name: torch.empty(shape, device="meta") for name, shape in parameter_shapes(hf.config).items()}
    expected = {name: tuple(t.shape) for name, t in hf.spec.hf.to_hf(meta, hf.config).items()}
    depths = mtp_tensors(hf, expected, lambda name: _find(folder, name) is not None)
    fresh = tuple(k for k, (needed, _) in enumerate(depths) if needed and all(_find(folder, n) is None for n in needed))
    skipped = {n for k in fresh for group in depths[k] for n in group}
    optional = {n for _, copies in depths for n in copies}  # the release's copies of shared tensors: not read
    names = {}
    for name, shape in expected.items():
        found = _find(folder, name)
        if name in skipped or (found is None and name in optional):
            continue
        if found is None:
            raise TensorFileError(f"{folder.weights}: no tensor {name!r}, which this {hf.config.family} model needs "
                                  f"(the folder holds {len(folder.names())} tensors; {hf.path / CONFIG_FILE} "
                                  f"describes the model)")
        info = folder.info(found)
        if info.shape != shape:
            raise TensorFileError(f"{info.file}: tensor {found!r} has shape {list(info.shape)}, {hf.path / CONFIG_FILE} "
                                  f"makes it {list(shape)}")
        if not info.dtype.is_floating_point:
            raise TensorFileError(f"{info.file}: tensor {found!r} is {str(info.dtype).removeprefix('torch.')}, "
                                  f"not a floating-point type")
        names[name] = found
    used = set(names.values())
    return HFWeights(model=hf, folder=folder, names=names, unused=tuple(n for n in folder.names() if n not in used),
                     fresh=fresh)


def mtp_tensors(hf: HFModel, expected: Mapping[str, Any], present) -> list[tuple[list[str], list[str]]]:
    """Per MTP depth of ``hf.config``, the Hugging Face names among ``expected`` it reads and the copies of shared
    tensors the release also stores there (models/common/mtp.py). A depth the folder holds part of (``present``
    says which) is a TensorFileError: its tensors do not match the config."""
    depths = []
    for k in range(mtp_depth(hf.config)):
        prefix = mtp_hf_prefix(hf.spec.hf, hf.config, k) + "."
        names = [n for n in expected if n.startswith(prefix)]
        copies = [n for n in names if n.removeprefix(prefix) in MTP_HF_COPIES]
        needed = [n for n in names if n not in copies]
        held = [n for n in needed if present(n)]
        if held and len(held) < len(needed):
            missing = next(n for n in needed if not present(n))
            raise TensorFileError(f"{hf.path}: multi-token-prediction depth {k + 1} ({prefix}*) has {len(held)} of its "
                                  f"{len(needed)} tensors ({missing!r} missing): the folder's tensors do not match "
                                  f"{hf.path / CONFIG_FILE} (num_nextn_predict_layers {mtp_depth(hf.config)}); "
                                  f"--mtp-depth {k} reads the depths before it")
        depths.append((needed, copies))
    return depths


def _find(folder: HFFolder | QuantizedFolder, name: str) -> str | None:
    """``name`` in the folder, or without its first component: a folder saved from the base model
    (transformers' ``base_model_prefix``, e.g. ``wte.weight`` for ``transformer.wte.weight``)."""
    if name in folder:
        return name
    base = name.split(".", 1)[-1]
    return base if "." in name and base in folder else None


class FolderValues:
    """Each of our parameters' full value by name, read lazily from the folder (see the module docstring),
    or only rows of it: ``rows`` reads a stacked parameter's (a mixture's experts') rows from their own tensors,
    so a rank holding experts a..b-1 reads only theirs (compiler/parallelize/materialize.py asks for them).
    Values keep the folder's dtype; the shard they are copied into converts them (fp32 parameters)."""

    def __init__(self, weights: HFWeights, *, seed: int = 0):
        self.weights, self.seed = weights, seed
        self.fresh = {f"{MTP}.layers.{k}." for k in weights.fresh}

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        model = self.weights.model
        if name.startswith(tuple(self.fresh)):  # an MTP depth the folder does not hold: name-seeded
            return model.spec.initial_value(name, shape, seed=self.seed, cfg=model.config)
        hf_names, combine = model.spec.hf.from_hf(name, model.config)
        full = combine(*self._read(hf_names))
        if tuple(full.shape) != tuple(shape):  # the run's model is the folder's: its window changes no shape
            raise TensorFileError(f"{name}: the folder gives shape {list(full.shape)}, the model needs {list(shape)}")
        return full

    def rows(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of ``name``'s value."""
        spec = self.weights.model.spec
        if name.startswith(tuple(self.fresh)):
            return self(name, shape)[start:stop]
        if spec.hf.row_wise(name):  # rows of each tensor: a quantized folder dequantizes only those
            hf_names, combine = spec.hf.from_hf(name, self.weights.model.config)
            return combine(*(self.weights.folder.read_rows(self.weights.names[n], start, stop) for n in hf_names))
        if not spec.hf.stacked(name):
            # memory-mapped: the pages of other rows are not read (a quantized tensor is dequantized whole here:
            # what the family marks row_wise is read by rows above)
            return self(name, shape)[start:stop]
        hf_names, _ = spec.hf.from_hf(name, self.weights.model.config)
        if len(hf_names) != shape[0]:
            raise TensorFileError(f"{name}: the folder gives {len(hf_names)} stacked tensors, the model needs {shape[0]}")
        part = self._read(hf_names[start:stop])
        return torch.stack(part) if part else torch.empty((0, *shape[1:]))

    def _read(self, hf_names) -> list[torch.Tensor]:
        return [self.weights.folder.read(self.weights.names[n]) for n in hf_names]


def initial_values(weights: HFWeights, *, seed: int = 0) -> FolderValues:
    """The folder's values; ``seed`` those of the MTP depths it does not hold."""
    return FolderValues(weights, seed=seed)


def read_state_dict(weights: HFWeights, run_cfg: Any, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter of ``run_cfg``'s model (the folder's, at any window; both copies of a tied weight), fp32,
    for one process."""
    value = initial_values(weights, seed=seed)
    return {name: value(name, shape).float() for name, shape in parameter_shapes(run_cfg).items()}


@dataclass(frozen=True)
class Carried:
    """What an export carries from a run's source folder."""

    config: dict[str, Any]  # the CARRIED_CONFIG_KEYS the folder's config.json sets (not to null)
    files: dict[str, bytes]  # the CARRIED_FILES the folder has, by name
    note: str | None = None  # why nothing could be carried, for the user

    def describe(self) -> str:
        return ", ".join([*self.config, *self.files])


def carried_from(init_from: str | None) -> Carried:
    """What an export of a run that started from ``--init-from`` (as its checkpoint recorded it) carries:
    nothing for a run from scratch or from a single-file export; a note when the folder cannot be read now
    (moved, or a relative path recorded from another working directory)."""
    if init_from is None or Path(init_from).is_file():
        return Carried({}, {})
    folder = Path(init_from)
    try:
        config = read_config(folder)
        files = {name: (folder / name).read_bytes() for name in CARRIED_FILES if (folder / name).is_file()}
    except (TensorFileError, OSError) as e:
        return Carried({}, {}, note=f"the run started from --init-from {init_from}, which cannot be read here ({e}); "
                                    f"writing the family's token ids and no {', '.join(CARRIED_FILES)}")
    return Carried({k: config[k] for k in CARRIED_CONFIG_KEYS if config.get(k) is not None}, files)
