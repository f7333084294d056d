"""Gradients in their parameters' layout before the fused AdamW step (runtime/engine/grad_layout.py): torch's
zero-bubble weight pass assigns gpt-oss's expert gradients transposed, which the CPU's fused kernel reads in the
wrong order (a 1x2x1 zbv gpt-oss run moved half of its experts' weights the wrong way at its first step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor import DTensor, Replicate

from models.gpt_oss.experts import ClampedSwiGLUExperts
from runtime.engine.grad_layout import restore_gradient_layouts
from runtime.engine.optim import build_optimizer
from runtime.engine.step import PipelineContext, run_schedule


def _experts() -> ClampedSwiGLUExperts:
    torch.manual_seed(0)
    return ClampedSwiGLUExperts(16, 8, 4, limit=7.0, alpha=1.702)  # D 16, F 8, E 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=generator, requires_grad=True)  # (M, D) rows sorted by expert
    return x, torch.tensor([3, 4, 2, 3]), torch.randn(12, 16, generator=generator)  # counts (E,), dy (M, D)


def _weights_after_one_fused_step(*, split_backward: bool, restore: bool) -> dict[str, torch.Tensor]:
    experts = _experts()
    x, counts, dy = _inputs()
    out = experts(x, counts)
    if split_backward:  # what ScheduleZBVZeroBubble's I and W actions run on a stage
        _, groups = stage_backward_input([out], [dy], [x], experts.parameters())
        stage_backward_weight(experts.parameters(), groups)
    else:
        out.backward(dy)
    if restore:
        restore_gradient_layouts(list(experts.parameters()))
    optimizer = build_optimizer(list(experts.parameters()), lr=1e-2, weight_decay=0.1)
    assert optimizer.defaults["fused"]  # the kernel that reads the gradient as flat memory
    optimizer.step()
    return {name: p.detach().clone() for name, p in experts.named_parameters()}


def test_the_weight_pass_leaves_expert_gradients_transposed():
    """The premise: the layout the engine must undo (were torch to keep the layout contract, this would fail)."""
    experts = _experts()
    x, counts, dy = _inputs()
    _, groups = stage_backward_input([experts(x, counts)], [dy], [x], experts.parameters())
    stage_backward_weight(experts.parameters(), groups)
    assert experts.down_proj.grad.stride() != experts.down_proj.stride()
    assert restore_gradient_layouts(list(experts.parameters())) == 2  # gate_up_proj and down_proj
    for name, p in experts.named_parameters():
        assert p.grad.stride() == p.stride(), name


def test_a_fused_adamw_step_after_the_weight_pass_matches_the_plain_backward():
    want = _weights_after_one_fused_step(split_backward=False, restore=False)
    got = _weights_after_one_fused_step(split_backward=True, restore=True)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_run_schedule_restores_the_layouts_a_schedule_left():
    """The engine's training pass does it after every schedule step, before anything reads the gradients."""
    weight = torch.nn.Parameter(torch.randn(2, 3, 4))
    assigned = torch.randn(2, 4, 3).transpose(1, 2)  # (2, 3, 4) with strides (12, 1, 3)

    def step(*args, **kwargs):  # as stage_backward_weight: ``weight.grad = dw``
        weight.grad = assigned

    stages = SimpleNamespace(has_first=True, has_last=False, gradient_factors={}, parameters=lambda: [weight])
    ctx = PipelineContext(schedule=SimpleNamespace(step=step), schedule_name="zbv", stages=stages,
                          device=torch.device("cpu"), precision="fp32")
    run_schedule(ctx, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), train=True)
    assert weight.grad.stride() == weight.stride()
    assert torch.equal(weight.grad, assigned)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("mp",))
    dist.destroy_process_group()


def test_a_dtensor_gradient_gets_its_parameter_local_layout(world_of_one):
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(2, 3, 4), world_of_one, [Replicate()]))
    local = torch.randn(2, 4, 3).transpose(1, 2)  # (2, 3, 4) with strides (12, 1, 3)
    param.grad = DTensor.from_local(local, world_of_one, [Replicate()], run_check=False)
    assert restore_gradient_layouts([param]) == 1
    assert isinstance(param.grad, DTensor) and param.grad.placements == (Replicate(),)
    assert param.grad.to_local().stride() == param.to_local().stride()
    assert torch.equal(param.grad.to_local(), local)
    assert restore_gradient_layouts([param]) == 0  # nothing left to copy
