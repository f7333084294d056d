"""Single-file weights: what ``run.py export`` writes and ``--init-from`` starts a run from.

The file is a plain ``{name: full tensor}`` state dict that the model's ``load_state_dict``
accepts, read from a DCP checkpoint in one process (no torchrun), model tensors only.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runtime.checkpoint.files import (
    MARKER,
    CheckpointError,
    CheckpointInfo,
    expected_parameter_shapes,
    find_latest,
    read_checkpoint,
    read_dcp_metadata,
)


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
            raise CheckpointError(f"--init-from {path} does not fit this model: {name} has shape {got}, this model "
                                  f"needs {expected.get(name, 'no such parameter')}")
