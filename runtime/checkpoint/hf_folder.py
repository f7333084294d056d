"""A Hugging Face model folder as a lazy source of tensors, and writing one.

A folder holds ``config.json`` and its weights in one of four layouts, read in this order of preference
(the order transformers' ``from_pretrained`` tries them in)::

    model.safetensors                    one safetensors file
    model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
                                         plus the shards it names (model-00001-of-00002.safetensors ...)
    pytorch_model.bin                    a torch.save'd state dict
    pytorch_model.bin.index.json         the same index over pytorch_model-00001-of-00002.bin ...

Opening reads the config and every weight file's directory (safetensors headers; the pickles of
``.bin`` files, memory-mapped), never tensor data; ``read(name)`` returns one tensor backed by the file's
pages, so a rank that narrows it to its shard and copies that reads only those bytes. Names are the
folder's own (``model.layers.0.self_attn.q_proj.weight``); mapping them to a model is the caller's job.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoint.safetensors import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsReader,
    ShardedWrite,
    TensorFileError,
    refuse_duplicate_keys,
    save_sharded,
    write_bytes,
    write_json,
)

CONFIG_FILE = "config.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE, BIN_FILE, BIN_INDEX_FILE)  # in order of preference
# transformers checks that a safetensors file's metadata says which framework wrote it.
SAFETENSORS_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path  # the weight file holding it


class _BinFile:
    """A ``torch.save``'d state dict, loaded memory-mapped (tensor bytes are read when touched)."""

    def __init__(self, path: Path):
        self.path = path
        # mmap needs the zip format (torch >= 1.6); older pickles are read whole.
        mapped = zipfile.is_zipfile(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
        except Exception as e:  # a truncated zip, a pickle that is not plain tensors, ...
            reason = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
            raise TensorFileError(f"{path}: not a readable PyTorch state dict (truncated or corrupt? {reason})") from None
        if not isinstance(state, Mapping):
            raise TensorFileError(f"{path}: holds a {type(state).__name__}, not a state dict")
        for name, value in state.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise TensorFileError(f"{path}: entry {name!r} is of type {type(value).__name__}, not a tensor")
        self.tensors: dict[str, torch.Tensor] = dict(state)

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors[name]
        return TensorInfo(name=name, shape=tuple(t.shape), dtype=t.dtype, file=self.path)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.reader = SafetensorsReader.open(path)

    def names(self) -> list[str]:
        return self.reader.names()

    def info(self, name: str) -> TensorInfo:
        e = self.reader.entry(name)
        return TensorInfo(name=name, shape=e.shape, dtype=e.dtype, file=self.reader.path)

    def read(self, name: str) -> torch.Tensor:
        return self.reader.read(name)


class TensorLookup:
    """A folder's per-tensor facts from its ``info``: shape, dtype and the file holding the tensor."""

    def info(self, name: str) -> TensorInfo:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).dtype

    def file_of(self, name: str) -> Path:
        return self.info(name).file


class HFFolder(TensorLookup):
    """``HFFolder.open(path)``: ``.config`` (dict), ``.weights`` (the file chosen), ``names()``,
    ``info(name)`` / ``shape`` / ``dtype`` / ``file_of``, and ``read(name)`` for one tensor."""

    def __init__(self, path: Path, config: dict, weights: Path, files: dict[str, _BinFile | _SafetensorsFile]):
        self.path = path
        self.config = config
        self.weights = weights
        self._files = files  # tensor name -> the file holding it, in the files' order

    @classmethod
    def open(cls, path: str | os.PathLike) -> HFFolder:
        path = Path(path)
        if not path.is_dir():
            raise TensorFileError(f"{path}: not a Hugging Face model folder (no such directory)")
        present = [name for name in WEIGHT_FILES if (path / name).is_file()]
        if not present:
            no_config = "" if (path / CONFIG_FILE).is_file() else f" and no {CONFIG_FILE}"
            raise TensorFileError(f"{path}: not a Hugging Face model folder: no weights (looked for "
                                  f"{', '.join(WEIGHT_FILES)}){no_config}")
        config = read_config(path)
        weights = path / present[0]
        opener = _SafetensorsFile if weights.name in (SINGLE_FILE, INDEX_FILE) else _BinFile
        if weights.name in (SINGLE_FILE, BIN_FILE):
            single = opener(weights)
            return cls(path, config, weights, dict.fromkeys(single.names(), single))
        weight_map = read_index(weights)
        opened = {file: opener(path / file) for file in dict.fromkeys(weight_map.values())}
        return cls(path, config, weights, _check_index(weights, weight_map, opened))

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor, backed by its file's pages (copy-on-write; disk is read as it is touched): narrow
        it to the part needed and copy that. For ``.bin`` files every read of a name returns the same
        tensor, so copy before writing to it."""
        return self._file(name).read(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0, a view of the file's pages (those of other rows are not read). The same
        call as a quantized folder's (runtime/checkpoint/quantized/folder.py), where it saves dequantizing."""
        tensor = self.read(name)
        if tensor.dim() == 0 or not 0 <= start <= stop <= tensor.shape[0]:
            raise TensorFileError(f"{self.file_of(name)}: tensor {name!r} of shape {list(tensor.shape)} has no rows "
                                  f"[{start}, {stop})")
        return tensor[start:stop]

    def _file(self, name: str) -> _BinFile | _SafetensorsFile:
        if name not in self._files:
            raise TensorFileError(f"{self.weights}: no tensor {name!r} (the folder's weights hold "
                                  f"{len(self._files)} tensors)")
        return self._files[name]


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TensorFileError(f"{path}: missing (a Hugging Face model folder has {CONFIG_FILE} next to "
                              f"its weights)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TensorFileError(f"{path}: cannot be read ({e})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise TensorFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(config, dict):
        raise TensorFileError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def read_index(path: Path) -> dict[str, str]:
    """An index's weight map (tensor name -> shard file name), every shard present in the folder."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"),
                           object_pairs_hook=refuse_duplicate_keys(path, "tensor {!r} is listed twice"))
    except (OSError, UnicodeDecodeError) as e:
        raise TensorFileError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise TensorFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise TensorFileError(f'{path}: an index needs a non-empty "weight_map" of tensor name -> file')
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise TensorFileError(f"{path}: tensor {name!r} maps to {file!r}, not a file name in the folder")
        if not (path.parent / file).is_file():
            raise TensorFileError(f"{path}: tensor {name!r} is in {file}, which is missing from {path.parent}")
    return weight_map


def _check_index(index: Path, weight_map: dict[str, str],
                 opened: dict[str, _BinFile | _SafetensorsFile]) -> dict[str, _BinFile | _SafetensorsFile]:
    """Each tensor in exactly one shard, the one the index names."""
    holder: dict[str, str] = {}
    for file, source in opened.items():
        for name in source.names():
            if name in holder:
                raise TensorFileError(f"{index.parent}: tensor {name!r} is listed twice, in {holder[name]} and {file}")
            if name not in weight_map:
                raise TensorFileError(f"{index.parent / file}: holds tensor {name!r}, which {index.name} does not list")
            holder[name] = file
    for name, file in weight_map.items():
        if holder.get(name) != file:
            elsewhere = f" (it is in {holder[name]})" if name in holder else ""
            raise TensorFileError(f"{index}: maps tensor {name!r} to {file}, which does not hold it{elsewhere}")
    return {name: opened[file] for name, file in weight_map.items()}  # the index's order


def write_hf_folder(folder: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    files: Mapping[str, bytes] | None = None) -> ShardedWrite:
    """``config.json`` plus ``model.safetensors`` (or shards and their index past ``max_shard_bytes``), and
    ``files`` (name -> bytes: e.g. ``generation_config.json`` carried from the folder a run started from).

    A new folder is written beside its final name and renamed into place, so it appears whole or not
    at all. Into an existing folder (one with a tokenizer, say) each file is replaced atomically, the
    weights first, then ``files``, and ``config.json`` last, and weight files of an earlier write go."""
    folder = Path(folder)
    try:
        config_text = json.dumps(dict(config))  # refuse what JSON cannot hold before writing anything
    except (TypeError, ValueError) as e:
        raise TensorFileError(f"{folder / CONFIG_FILE}: the config cannot be written as JSON ({e})") from None
    if folder.is_dir():
        written = save_sharded(tensors, folder, max_shard_bytes=max_shard_bytes, metadata=SAFETENSORS_METADATA)
        _write_files(folder, files or {})
        write_json(folder / CONFIG_FILE, json.loads(config_text))
        return written
    staging = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.tmp")
    try:
        staging.mkdir(parents=True)  # the umask's mode, as the folder itself would get
    except OSError as e:
        raise TensorFileError(f"{folder}: cannot be created ({e.strerror or e})") from None
    try:
        written = save_sharded(tensors, staging, max_shard_bytes=max_shard_bytes, metadata=SAFETENSORS_METADATA)
        _write_files(staging, files or {})
        write_json(staging / CONFIG_FILE, json.loads(config_text))
        os.rename(staging, folder)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise TensorFileError(f"{folder}: cannot be written ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _write_files(folder: Path, files: Mapping[str, bytes]) -> None:
    for name, data in files.items():
        if Path(name).name != name or name in (CONFIG_FILE, *WEIGHT_FILES):
            raise TensorFileError(f"{folder}: {name!r} is not a file an export carries (a plain name, not "
                                  f"config.json or a weight file)")
        write_bytes(folder / name, data)
