"""Activation checkpointing: keep only each block's input and recompute its inside in backward.

Per block this trades one extra forward (about 1/3 more compute) for not storing the block's
intermediate activations (attention scores, MLP hidden states) of every in-flight micro-batch.
"""

from __future__ import annotations

from torch import nn

from compiler.parallelize.tensor_parallel import block_names
from compiler.torch_compat import checkpoint_wrapper

# The wrapper's name is not part of the model's parameter names.
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def original_name(stage_parameter_name: str) -> str:
    """The model's name of a stage module's parameter ("layers.3.attn.qkv.weight"), with or without AC."""
    return stage_parameter_name.replace(_WRAPPER_PREFIX, "")


def apply_ac(stage_module: nn.Module) -> nn.Module:
    for name in block_names(stage_module):
        # The traced parent graph calls the block by name, so swapping in a wrapper is transparent.
        stage_module.set_submodule(name, checkpoint_wrapper(stage_module.get_submodule(name), preserve_rng_state=False))
    return stage_module
