"""Activation checkpointing: keep less of each block for backward and recompute the rest.

- ``full``: keep only each block's input and recompute its whole forward in backward. Per block this
  trades one extra forward (about 1/3 more compute) for not storing the block's intermediate activations
  (attention outputs, MLP hidden states) of every in-flight micro-batch.
- ``selective`` (op-level, as torchtitan's ``--activation-checkpoint.mode selective``): keep the block's input
  and the outputs of its matrix products and attention, recompute the rest (norms, activation functions,
  RoPE, casts, residual adds: cheap elementwise work). torch's selective checkpointing
  (``create_selective_checkpoint_contexts``) runs the forward under a dispatch mode that caches the outputs
  of ``SAVED_OPS``; the backward's recomputation takes them from the cache instead of running the op again.
  The ops are the ones the dispatcher sees below autograd: ``nn.Linear`` arrives as ``mm`` / ``addmm``, DTensor
  ops before DTensor runs them (their outputs are DTensors), and the sequence-parallel reduce-scatter's
  output is kept too (torchtitan's list), so it is not communicated again. Unlike torchtitan's default
  policy, every matrix product is kept (torchtitan keeps every other one).
compiler/cost.py counts the bytes each mode keeps with the same op list.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from compiler.parallelize.tensor_parallel import block_names
from compiler.torch_compat import RecomputeFromCacheEveryTime, checkpoint_wrapper

AC_MODES = ("none", "full", "selective")

# The wrapper's name is not part of the model's parameter names.
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def _ops(*names: str) -> tuple:
    """The default overloads of the named aten / functional-collective ops this torch has."""
    found = []
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return tuple(found)


# Matrix products, every attention kernel F.scaled_dot_product_attention may pick (CPU flash, CUDA flash,
# memory-efficient, cuDNN, math) and the banded attention of sliding windows and sinks (models/common/
# banded_attention.py), and the reduce-scatter of sequence parallelism.
SAVED_OPS = frozenset(_ops(
    "aten.mm", "aten.addmm", "aten.bmm",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math", "attention.banded",
    "_c10d_functional.reduce_scatter_tensor",
))


def original_name(stage_parameter_name: str) -> str:
    """The model's name of a stage module's parameter ("layers.3.attn.qkv.weight"), with or without AC."""
    return stage_parameter_name.replace(_WRAPPER_PREFIX, "")


def apply_ac(stage_module: nn.Module, *, mode: str = "full", preserve_rng_state: bool = False) -> nn.Module:
    """Wrap each block of ``stage_module`` in a checkpoint of ``mode`` ("full" or "selective"). ``preserve_rng_state``:
    the recomputation replays the forward's random numbers (a block with dropout: LoRA's)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be full or selective, got {mode!r}")
    options = {"context_fn": selective_checkpoint_contexts} if mode == "selective" else {}
    for name in block_names(stage_module):
        # The traced parent graph calls the block by name, so swapping in a wrapper is transparent.
        block = stage_module.get_submodule(name)
        stage_module.set_submodule(name, checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state, **options))
    return stage_module


def selective_checkpoint_contexts():
    """The (forward, recompute) context managers of one selective checkpoint: keep ``SAVED_OPS``' outputs,
    for as many recomputations as the schedule's backward passes make (two under a split backward)."""
    forward, recompute = create_selective_checkpoint_contexts(list(SAVED_OPS))
    return forward, RecomputeFromCacheEveryTime(recompute)


def maybe_apply_ac(stage_module: nn.Module, mode: str, *, preserve_rng_state: bool = False) -> nn.Module:
    return stage_module if mode == "none" else apply_ac(stage_module, mode=mode, preserve_rng_state=preserve_rng_state)
