"""A float32 state dict in a released quantized layout, and the ``quantization_config`` that describes it.

    export = quantize_for_export(tensors, method="fp8-blocks", which=["model.layers.*_proj.weight"])
    config["quantization_config"] = export.quantization_config
    write_hf_folder(out, export.tensors, config)            # runtime/checkpoint/hf_folder.py

Which tensors are quantized is the family's choice, given as ``which`` (a predicate of Hugging Face names, or
fnmatch patterns, where ``*`` also matches dots). The released checkpoints choose (tests/fixtures/hf-models):

- DeepSeek-V3, ``fp8-blocks`` at [128, 128] (the fixture: [16, 16]): every linear weight inside the decoder
  layers, ``["model.layers.*_proj.weight", "model.layers.*_proj_with_mqa.weight"]`` (q_a/q_b/kv_a/kv_b/o,
  the dense and shared MLPs, every routed expert); not the router ``mlp.gate.weight``, norms, embeddings, head.
- gpt-oss, ``mxfp4``: the experts, ``["model.layers.*.mlp.experts.gate_up_proj",
  "model.layers.*.mlp.experts.down_proj"]`` (their biases stay float32), with ``modules_to_not_convert``
  ``["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from runtime.checkpoint.quantized import mxfp4
from runtime.checkpoint.quantized.layouts import Fp8Blocks, Mxfp4Experts

METHODS = ("fp8-blocks", "mxfp4")


@dataclass(frozen=True)
class QuantizedExport:
    tensors: dict[str, torch.Tensor]  # the released layout: stored parts in place of each quantized tensor
    quantization_config: dict  # for config.json
    quantized: tuple[str, ...]  # the names given that were quantized


def name_patterns(patterns: Sequence[str]) -> Callable[[str], bool]:
    """A predicate true for names matching any fnmatch pattern (``*`` matches any run, dots included)."""
    patterns = tuple(patterns)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantize_for_export(tensors: Mapping[str, torch.Tensor], *, method: str,
                        which: Callable[[str], bool] | Sequence[str],
                        block_size: tuple[int, int] | None = None,
                        modules_to_not_convert: Sequence[str] | None = None) -> QuantizedExport:
    """``tensors`` (Hugging Face names, floating point) with those ``which`` selects stored in ``method``'s layout:
    ``fp8-blocks`` (DeepSeek-V3; ``block_size`` (rows, columns), default [128, 128]) turns a matrix ``X.weight``
    into float8_e4m3fn ``X.weight`` + ``X.weight_scale_inv``; ``mxfp4`` (gpt-oss; blocks of 32, no block size)
    turns an expert tensor ``X`` [E, in, out] into ``X_blocks`` + ``X_scales``. Other tensors pass unchanged.
    ``modules_to_not_convert``: written into the config when given (the released gpt-oss lists it).
    ValueError naming the argument or tensor on bad input."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not a quantized layout (choose from {', '.join(METHODS)})")
    if method == "mxfp4" and block_size is not None:
        raise ValueError(f"block_size {block_size!r}: mxfp4's blocks are {mxfp4.BLOCK} elements of a row; give none")
    try:
        layout = Fp8Blocks(tuple(block_size or (128, 128))) if method == "fp8-blocks" else Mxfp4Experts()
    except (ValueError, TypeError):
        raise ValueError(f"block_size must be two positive integers (rows, columns), got {block_size!r}") from None
    selected = name_patterns(which) if isinstance(which, (list, tuple)) else which
    if not callable(selected):
        raise ValueError(f"which must be a predicate of names or a list of name patterns, got {which!r}")
    out: dict[str, torch.Tensor] = {}
    quantized = []
    for name, tensor in tensors.items():
        if not selected(name):
            out[name] = tensor
            continue
        try:
            parts = layout.store(name, tensor)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        clash = [part for part in parts if part != name and part in tensors]
        if clash:
            raise ValueError(f"tensor {name!r}: its {method} part {clash[0]!r} is also a tensor of the state dict")
        out.update(parts)
        quantized.append(name)
    if not quantized:
        raise ValueError(f"which selects none of the {len(tensors)} tensors (nothing to store as {method})")
    config = layout.config()
    if modules_to_not_convert is not None:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return QuantizedExport(tensors=out, quantization_config=config, quantized=tuple(quantized))
