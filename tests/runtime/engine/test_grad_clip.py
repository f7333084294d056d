"""runtime/engine/grad_clip.py clip_grads_: gradients scaled to the global norm, and a rank whose stage trains
nothing (no gradient at all: LoRA's frozen embedding alone on its stage) passes the clip."""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.grad_clip import clip_grads_


def test_gradients_are_scaled_to_the_global_norm():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    clip_grads_([p], max_norm=1.0, total_norm=10.0)  # the world's norm, not this rank's 5
    torch.testing.assert_close(p.grad, torch.tensor([0.3, 0.4, 0.0]), rtol=1e-5, atol=0)


def test_a_stage_without_gradients_is_left_alone():
    frozen = [nn.Parameter(torch.ones(2), requires_grad=False), nn.Parameter(torch.ones(2))]  # neither has a .grad
    clip_grads_(frozen, max_norm=1.0, total_norm=10.0)
    assert all(p.grad is None for p in frozen)
