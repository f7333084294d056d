"""Weights a run starts from: single-file exports (what ``run.py export`` writes: a plain ``{name: full tensor}``
state dict that the model's ``load_state_dict`` accepts, read from a DCP checkpoint in one process, model tensors
only), Hugging Face folders (runtime/checkpoint/hf_weights.py), or name-seeded values (``initial_values``).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from compiler.lora import LoraConfig, adapter_initial_value, is_adapter
from models import mtp_depth, spec_of
from runtime.checkpoint.files import (
    MARKER,
    CheckpointError,
    CheckpointInfo,
    expected_parameter_shapes,
    find_latest,
    read_checkpoint,
    read_dcp_metadata,
)
from runtime.checkpoint.hf_weights import check_weights, read_hf_model
from runtime.checkpoint.hf_weights import initial_values as hf_initial_values
from runtime.checkpoint.peft import read_adapter

InitialValue = Callable[[str, tuple[int, ...]], torch.Tensor]  # a parameter's full value by name


def resolve_checkpoint(path: Path) -> CheckpointInfo:
    if (path / MARKER).is_file():
        info, _notes = find_latest(path)
        if info is None:
            raise CheckpointError(f"--checkpoint {path}: no complete checkpoint in this folder")
        return info
    return read_checkpoint(path)


def load_model_weights(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors from a DCP checkpoint, read in this process alone."""
    metadata = read_dcp_metadata(info.path)
    state = {"model": {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }}
    try:
        with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=info.path, no_dist=True)
    except BaseException as e:  # DCP wraps failures in CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"checkpoint {info.path} cannot be read: {str(e).strip().splitlines()[-1]}") from None
    return state["model"]


def read_init_weights(path: Path, model_cfg) -> dict[str, torch.Tensor]:
    """An export's tensors (memory-mapped), checked against this run's model shape."""
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"--init-from {path}: not a readable state dict ({type(e).__name__}: {e})") from None
    _check_shapes(weights, path, model_cfg)
    return weights


def _check_shapes(weights: dict, path: Path, model_cfg) -> None:
    expected = expected_parameter_shapes(model_cfg)
    if not isinstance(weights, dict):
        raise CheckpointError(f"--init-from {path}: holds a {type(weights).__name__}, not a state dict")
    for name in sorted(set(expected) | set(weights)):
        got = tuple(weights[name].shape) if name in weights else "missing"
        if got != expected.get(name):
            hint = " (a multi-token-prediction depth's: --mtp-depth sets how many)" if name.startswith("mtp.") else ""
            raise CheckpointError(f"--init-from {path} does not fit this model: {name} has shape {got}, this model "
                                  f"needs {expected.get(name, 'no such parameter')}{hint}")


def check_init_from(init_from: str | None, model_cfg) -> str | None:
    """Headers and shapes of ``--init-from`` (a Hugging Face folder or an export) checked before any process
    group; returns a note to print (tensors of a folder the model does not use), or None."""
    if init_from and Path(init_from).is_dir():
        return check_weights(read_hf_model(init_from, mtp_depth=mtp_depth(model_cfg))).note()
    if init_from:
        read_init_weights(Path(init_from), model_cfg)
    return None


def initial_values(init_from: str | None, model_cfg, *, seed: int, lora: LoraConfig | None = None) -> InitialValue:
    """Each parameter's full initial value by name: from ``--init-from``'s Hugging Face folder (read lazily, only
    the tensors of this rank's parameters) or export (memory-mapped: read as shards need it), else name-seeded;
    with ``lora``, the adapters' from its peft folder (``--lora-from``), else name-seeded (compiler/lora/modules.py).
    Training and evaluation read weights through this one function."""
    if init_from and Path(init_from).is_dir():
        base = hf_initial_values(check_weights(read_hf_model(init_from, mtp_depth=mtp_depth(model_cfg))), seed=seed)
    elif init_from:
        weights = read_init_weights(Path(init_from), model_cfg)
        base = lambda name, shape: weights[name]  # noqa: E731
    else:
        base = functools.partial(spec_of(model_cfg).initial_value, seed=seed, cfg=model_cfg)
    if lora is None:
        return base
    adapters = functools.partial(adapter_initial_value, seed=seed)
    if lora.init_from:
        _, values = read_adapter(lora.init_from, model_cfg)
        adapters = lambda name, shape: values[name]  # noqa: E731
    return (WithAdapterRows if hasattr(base, "rows") else WithAdapters)(base, adapters)


class WithAdapters:
    """``base``'s values, and ``adapters``' for LoRA's adapters."""

    def __init__(self, base: InitialValue, adapters: InitialValue):
        self.base, self.adapters = base, adapters

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.adapters(name, shape) if is_adapter(name) else self.base(name, shape)


class WithAdapterRows(WithAdapters):
    """``WithAdapters`` over a source that reads rows of dim 0 alone (compiler/parallelize/materialize.py)."""

    def rows(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        return self(name, shape)[start:stop] if is_adapter(name) else self.base.rows(name, shape, start, stop)
