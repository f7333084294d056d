"""``--compile``: each transformer block's forward through ``torch.compile`` (inductor).

Applied after tensor parallelism and activation checkpointing and before FSDP, the order torchtitan
uses: a block's TP redistributions and its checkpointed recomputation are inside the compiled region,
FSDP's gather and reshard hooks stay outside it (they run in ``nn.Module.__call__``, around the compiled
``forward``). Only ``forward`` is replaced, so parameter names, and with them checkpoints, do not change.

On CPU inductor generates C++ (the system compiler); on this 2-core machine compiled blocks trained at
0.93-0.97x eager (ENGINEERING_NOTES.md), so it is a switch for accelerators rather than a speed-up here.
Every traced block is a module of its own type calling the same ``forward`` code, so dynamo compiles
each block once (a guard on its graph's type) and inductor's cache reuses the generated code across
blocks of one shape; the recompile limit is raised by the number of blocks, or blocks past dynamo's
default 8 would silently run eager.
"""

from __future__ import annotations

import torch
from torch import nn

from compiler.parallelize.tensor_parallel import block_names
from compiler.torch_compat import raise_recompile_limit


def apply_compile(stage_module: nn.Module) -> nn.Module:
    names = block_names(stage_module)
    raise_recompile_limit(len(names))
    for name in names:
        block = stage_module.get_submodule(name)
        block.forward = torch.compile(block.forward)
    return stage_module
