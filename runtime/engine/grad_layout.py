"""Gradients put back into their parameters' memory layout before the optimizer reads them.

autograd's AccumulateGrad gives a new gradient its parameter's strides (the "gradient layout contract"), but torch's
zero-bubble weight pass assigns the result of ``autograd.grad`` as it comes (``weight.grad = dw`` in
torch/distributed/pipelining/_backward.py ``stage_backward_weight``), and later micro-batches add into it in place.
A weight whose gradient an op computes transposed, as the experts' stacked ``[E, F, D]`` matrices from a grouped
product, then holds a gradient with other strides than its own under zbv, dualpipev and zero-bubble. FSDP's
reduce-scatter writes fresh gradients; without it (dp 1, replicated DP) the gradient reaches the fused AdamW kernel,
which reads both tensors as flat memory in the parameter's order: CPU silently pairs each weight with another
element's gradient, CUDA refuses the step ("params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device,
and layout", pytorch/pytorch issue 106951).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def restore_gradient_layouts(params: list[nn.Parameter]) -> int:
    """Copy every gradient among ``params`` whose strides differ from its parameter's into the parameter's layout
    (a DTensor's local shard against the parameter's local shard); returns the number copied."""
    copied = 0
    for p in params:
        g = p.grad
        if g is None:
            continue
        local_p = p.to_local() if isinstance(p, DTensor) else p
        local_g = g.to_local() if isinstance(g, DTensor) else g
        if local_g.stride() == local_p.stride() or local_g.shape != local_p.shape:
            continue
        fixed = torch.empty_like(local_p, dtype=local_g.dtype).copy_(local_g)  # empty_like keeps p's strides
        p.grad = (DTensor.from_local(fixed, g.device_mesh, g.placements, run_check=False, shape=p.shape,
                                     stride=p.stride()) if isinstance(g, DTensor) else fixed)
        copied += 1
    return copied
