"""The dtype of pipeline messages: activations sent forward and their gradients sent back.

Under autocast the tensors a stage hands on are low-precision values already (matrix products run in
bf16 / fp16), so sending them in fp32 moves twice the bytes Megatron-LM moves: it sends in the
parameters' dtype (``pipeline_dtype``). The traced graph says fp32 (it was traced without autocast),
and torch's pipeline stage sizes its receive buffers, and checks what a stage produces (always on torch
2.11, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on 2.13), from the graph's values: the placeholders a
stage receives and the values it outputs (``node.meta["val"]``). So both are set here, with a cast at
each end of the stage:

- a stage's outputs leave in the message dtype, the last stage's logits too: the loss casts them to fp32
  itself (runtime/engine/amp.py), a copy that lives only until the log-softmax, whereas a stage's output
  is kept from its forward to its backward (an fp32 copy of GPT-2's [8, 1024, 50257] logits held 1.5 GiB
  more at the step's peak on an H200); the gradients it receives for them arrive in that dtype too (the
  buffers follow its outputs);
- a stage receives activations in the message dtype and casts them to the dtype it computes in (fp32,
  or FSDP's parameter dtype, to which FSDP casts its inputs anyway), so inside a stage nothing changes:
  only the values crossing a stage boundary are rounded. The gradient it sends back is in the message
  dtype, cast by that same input cast's backward.

fp16's loss scale is applied before any gradient is sent (runtime/engine/amp.py): scaled gradients keep
fp16's range as they do inside the stages, and an overflow in a message becomes an inf in some gradient,
which the world-wide vote catches.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_message_dtype(stage_module: nn.Module, message: torch.dtype, *, compute: torch.dtype,
                        receives: bool) -> nn.Module:
    """Make the traced stage ``stage_module`` receive (``receives``: not the first stage) and output floating
    tensors in ``message``, computing in ``compute`` between the two casts. The last stage's logits leave in
    ``message`` too (under autocast the head computes them in it)."""
    nodes = list(stage_module.graph.nodes)
    if receives:
        _set_dtype([n for n in nodes if n.op == "placeholder"], message)
    (output,) = [n for n in nodes if n.op == "output"]
    _set_dtype(list(_flatten(output.args)), message)
    if receives:
        stage_module.register_forward_pre_hook(lambda _module, args: _cast(args, compute))
    stage_module.register_forward_hook(lambda _module, _args, out: _cast(out, message))
    return stage_module


def _set_dtype(nodes: list[torch.fx.Node], dtype: torch.dtype) -> None:
    """Give the nodes' floating example values ``dtype`` (same shape and strides, on the meta device)."""
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            node.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=dtype, device="meta")


def _flatten(args) -> list:
    if isinstance(args, (tuple, list)):
        return [leaf for a in args for leaf in _flatten(a)]
    return [args] if isinstance(args, torch.fx.Node) else []


def _cast(values, dtype: torch.dtype):
    if isinstance(values, torch.Tensor):
        return values.to(dtype) if values.is_floating_point() else values
    if isinstance(values, tuple):
        return tuple(_cast(v, dtype) for v in values)
    return values
