"""How a quantized Hugging Face folder stores its tensors: one layout per ``quantization_config.quant_method``.

A layout finds, from the headers alone, each tensor the folder keeps quantized: the logical tensor (the name and
float32 shape an unquantized folder of the model has) and the two stored tensors it is made of. It reads one back
(all of it, or rows of dim 0, slicing the stored tensors first) and, for an export, stores a float32 tensor::

    fp8    X.weight  float8_e4m3fn [R, C]  +  X.weight_scale_inv  float32 [ceil(R / b0), ceil(C / b1)]
           -> X.weight [R, C]                                      (DeepSeek-V3; fp8_blocks.py)
    mxfp4  X_blocks  uint8 [E, out, in / 32, 16]  +  X_scales  uint8 [E, out, in / 32]
           -> X [E, in, out]                                       (gpt-oss's experts; mxfp4.py)

Which tensors are quantized is read from the names and dtypes, not from ``modules_to_not_convert`` (a list of
module patterns for transformers' module swap): a scale tensor beside its codes is what makes a tensor quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoint.hf_folder import HFFolder
from runtime.checkpoint.quantized import fp8_blocks, mxfp4
from runtime.checkpoint.safetensors import TensorFileError


@dataclass(frozen=True)
class Stored:
    """A logical tensor the folder keeps quantized."""

    name: str
    shape: tuple[int, ...]  # its float32 shape
    parts: tuple[str, str]  # the folder's tensors it is made of: (codes, scales)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Fp8Blocks:
    """DeepSeek-V3's block FP8: ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b0, b1]}``."""

    quant_method = "fp8"
    SCALE = "_scale_inv"  # X.weight's scales are X.weight_scale_inv

    def __init__(self, block: tuple[int, int] = (128, 128)):
        self.block = fp8_blocks.check_block(tuple(block))

    @classmethod
    def from_config(cls, qconfig: dict, where: Path) -> Fp8Blocks:
        fmt = qconfig.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise TensorFileError(f"{where}: quantization_config.fmt {fmt!r} is not read here (fp8 weights are read "
                                  f"as e4m3, float8_e4m3fn)")
        # transformers' FineGrainedFP8Config defaults to 128 x 128 blocks, DeepSeek-V3's; its files state theirs.
        block = qconfig.get("weight_block_size", [128, 128])
        try:
            return cls(tuple(block) if isinstance(block, (list, tuple)) else (block,))
        except ValueError:
            raise TensorFileError(f"{where}: quantization_config.weight_block_size must be two positive integers "
                                  f"[rows, columns], got {block!r}") from None

    def find(self, folder: HFFolder) -> dict[str, Stored]:
        found: dict[str, Stored] = {}
        for name in folder.names():
            if not name.endswith(self.SCALE):
                continue
            weight, scale = name.removesuffix(self.SCALE), folder.info(name)
            if weight not in folder:
                raise TensorFileError(f"{scale.file}: tensor {name!r} holds the scales of {weight!r}, which the folder "
                                      f"does not hold")
            w = folder.info(weight)
            if w.dtype != torch.float8_e4m3fn or len(w.shape) != 2:
                raise TensorFileError(f"{w.file}: tensor {weight!r} is {_dtype(w.dtype)} {list(w.shape)}; beside "
                                      f"{name!r} it must be a float8_e4m3fn matrix (quantization_config fp8, e4m3)")
            grid = fp8_blocks.grid_shape(w.shape, self.block)
            if scale.shape != grid or not scale.dtype.is_floating_point:
                raise TensorFileError(f"{scale.file}: tensor {name!r} is {_dtype(scale.dtype)} {list(scale.shape)}; "
                                      f"{weight!r} {list(w.shape)} in blocks of {list(self.block)} (quantization_config."
                                      f"weight_block_size) needs floating-point scales {list(grid)}")
            found[weight] = Stored(weight, w.shape, (weight, name))
        for name in folder.names():
            info = folder.info(name)
            if info.dtype == torch.float8_e4m3fn and name not in found:
                raise TensorFileError(f"{info.file}: tensor {name!r} is float8_e4m3fn without its scales "
                                      f"{name + self.SCALE!r} (quantization_config fp8 stores one per weight)")
        return found

    def read(self, folder: HFFolder, stored: Stored, start: int, stop: int) -> torch.Tensor:
        weight, scale = stored.parts
        return fp8_blocks.dequantize_rows(folder.read(weight), folder.read(scale), self.block, start, stop)

    def store(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale_inv = fp8_blocks.quantize(tensor, self.block)
        return {name: codes, name + self.SCALE: scale_inv}

    def config(self) -> dict:
        """DeepSeek-V3's ``quantization_config`` (activations are quantized on the fly, per 1 x 128 tile)."""
        return {"quant_method": self.quant_method, "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}


class Mxfp4Experts:
    """gpt-oss's MXFP4 experts: ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``."""

    quant_method = "mxfp4"
    BLOCKS, SCALES = "_blocks", "_scales"

    @classmethod
    def from_config(cls, qconfig: dict, where: Path) -> Mxfp4Experts:
        return cls()

    def find(self, folder: HFFolder) -> dict[str, Stored]:
        found: dict[str, Stored] = {}
        for name in folder.names():
            if not name.endswith(self.BLOCKS):
                continue
            base = name.removesuffix(self.BLOCKS)
            scales_name, blocks = base + self.SCALES, folder.info(name)
            if scales_name not in folder:
                raise TensorFileError(f"{blocks.file}: tensor {name!r} has no scales {scales_name!r} beside it "
                                      f"(quantization_config mxfp4 stores each block tensor with its E8M0 scales)")
            if base in folder:
                raise TensorFileError(f"{folder.file_of(base)}: tensor {base!r} is also stored quantized as {name!r}")
            scales = folder.info(scales_name)
            if blocks.dtype != torch.uint8 or len(blocks.shape) != 4 or blocks.shape[-1] != mxfp4.BLOCK // 2:
                raise TensorFileError(f"{blocks.file}: tensor {name!r} is {_dtype(blocks.dtype)} {list(blocks.shape)}; "
                                      f"MXFP4 expert blocks are uint8 [experts, out, in / 32, 16]")
            if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
                raise TensorFileError(f"{scales.file}: tensor {scales_name!r} is {_dtype(scales.dtype)} "
                                      f"{list(scales.shape)}; its blocks {name!r} {list(blocks.shape)} need uint8 "
                                      f"{list(blocks.shape[:-1])}")
            experts, out, n_blocks, _ = blocks.shape
            found[base] = Stored(base, (experts, n_blocks * mxfp4.BLOCK, out), (name, scales_name))
        paired = {s.parts[1] for s in found.values()}
        for name in folder.names():
            if name.endswith(self.SCALES) and name not in paired and folder.dtype(name) == torch.uint8:
                raise TensorFileError(f"{folder.file_of(name)}: tensor {name!r} has no blocks "
                                      f"{name.removesuffix(self.SCALES) + self.BLOCKS!r} beside it")
        return found

    def read(self, folder: HFFolder, stored: Stored, start: int, stop: int) -> torch.Tensor:
        blocks, scales = stored.parts
        return mxfp4.unpack_experts(folder.read(blocks), folder.read(scales), start, stop)

    def store(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        blocks, scales = mxfp4.pack_experts(tensor)
        return {name + self.BLOCKS: blocks, name + self.SCALES: scales}

    def config(self) -> dict:
        return {"quant_method": self.quant_method}


READERS = {layout.quant_method: layout for layout in (Fp8Blocks, Mxfp4Experts)}  # quant_method -> layout


def layout_of(qconfig: object, where: Path) -> Fp8Blocks | Mxfp4Experts:
    """The layout config.json's ``quantization_config`` names; TensorFileError naming ``where`` otherwise."""
    if not isinstance(qconfig, dict):
        raise TensorFileError(f"{where}: quantization_config must be an object, got {qconfig!r}")
    method = qconfig.get("quant_method")
    if method not in READERS:
        raise TensorFileError(f"{where}: quantization_config.quant_method {method!r} is not a format this engine "
                              f"reads (it reads {', '.join(READERS)})")
    return READERS[method].from_config(qconfig, where)
