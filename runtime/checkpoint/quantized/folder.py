"""A quantized Hugging Face folder seen as the unquantized folder it stands for.

``open_folder(path)`` is ``HFFolder.open(path)`` for a plain folder. When ``config.json`` holds a
``quantization_config``, it wraps the folder in a ``QuantizedFolder``: the same interface (``names``, ``info``,
``shape``, ``dtype``, ``file_of``, ``read``, ``read_rows``), but each tensor stored quantized appears under its
logical name, float32 and of its logical shape (``model.layers.0.self_attn.q_a_proj.weight`` from ``.weight``
+ ``.weight_scale_inv``; ``mlp.experts.gate_up_proj`` [E, in, out] from ``gate_up_proj_blocks`` + ``_scales``),
and its stored parts do not appear at all. So ``check_weights`` and the families' ``from_hf`` see the names and
shapes of an unquantized folder, and nothing about the format leaks past this file.

Opening reads headers only and checks every quantized pair (TensorFileError naming the file and tensor). Reads
are lazy: ``read`` dequantizes one tensor when asked; ``read_rows(name, start, stop)`` slices the stored
tensors to those rows first (an FP8 weight's rows and their scale rows; an MXFP4 tensor's experts), so on the
memory-mapped files the other rows' pages are never touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.checkpoint.hf_folder import CONFIG_FILE, HFFolder, TensorInfo, TensorLookup
from runtime.checkpoint.quantized.layouts import Fp8Blocks, Mxfp4Experts, Stored, layout_of
from runtime.checkpoint.safetensors import TensorFileError

QUANTIZATION_CONFIG = "quantization_config"


def open_folder(path: str | os.PathLike) -> HFFolder | QuantizedFolder:
    """The folder's logical tensors: a QuantizedFolder when config.json has ``quantization_config``."""
    folder = HFFolder.open(path)
    if QUANTIZATION_CONFIG not in folder.config:
        return folder
    return QuantizedFolder(folder, layout_of(folder.config[QUANTIZATION_CONFIG], folder.path / CONFIG_FILE))


class QuantizedFolder(TensorLookup):
    """An HFFolder whose quantized tensors are read as float32 under their logical names (module docstring)."""

    def __init__(self, folder: HFFolder, layout: Fp8Blocks | Mxfp4Experts):
        self.folder = folder
        self.layout = layout
        self.stored: dict[str, Stored] = layout.find(folder)  # logical name -> its stored parts
        part_of = {part: stored for stored in self.stored.values() for part in stored.parts}
        # The folder's order, each pair listed once, where its codes are.
        self._names = [part_of[name].name if name in part_of else name for name in folder.names()
                       if name not in part_of or name == part_of[name].parts[0]]
        self._known = set(self._names)

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def config(self) -> dict:
        return self.folder.config

    @property
    def weights(self) -> Path:
        return self.folder.weights

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._known

    def info(self, name: str) -> TensorInfo:
        self._check(name)
        stored = self.stored.get(name)
        if stored is None:
            return self.folder.info(name)
        return TensorInfo(name=name, shape=stored.shape, dtype=torch.float32, file=self.folder.file_of(stored.parts[0]))

    def read(self, name: str) -> torch.Tensor:
        """The tensor: dequantized to float32 if stored quantized, else the folder's own (memory-mapped)."""
        self._check(name)
        stored = self.stored.get(name)
        if stored is None:
            return self.folder.read(name)
        return self.layout.read(self.folder, stored, 0, stored.shape[0])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of ``read(name)``, reading only what those rows are made of."""
        self._check(name)
        stored = self.stored.get(name)
        if stored is None:
            return self.folder.read_rows(name, start, stop)
        if not 0 <= start <= stop <= stored.shape[0]:
            raise TensorFileError(f"{self.file_of(name)}: tensor {name!r} has {stored.shape[0]} rows, not "
                                  f"[{start}, {stop})")
        return self.layout.read(self.folder, stored, start, stop)

    def _check(self, name: str) -> None:
        if name not in self._known:
            raise TensorFileError(f"{self.folder.weights}: no tensor {name!r} (the folder's weights hold "
                                  f"{len(self._names)} tensors, read through its {QUANTIZATION_CONFIG})")
