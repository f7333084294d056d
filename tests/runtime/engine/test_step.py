"""The optimizer half of a training step (runtime/engine/step.py), in one process: a skipped step (a
non-finite loss or gradient norm in fp32/bf16, an fp16 overflow) changes no weight and does not advance the
LR schedule; a good step does both. (Skips on real ranks: tests/runtime/engine/test_guards.py, tests/launches/test_amp.py.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from runtime.engine.amp import build_grad_scaler
from runtime.engine.optim import build_lr_schedule
from runtime.engine.step import PipelineContext, StepContext, _optimizer_step


def _context(precision: str, fused: bool) -> StepContext:
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=1e-2, fused=fused)  # fused: skipped on the device (step_unless)
    pipeline = PipelineContext(schedule=None, schedule_name="1f1b", stages=SimpleNamespace(parameters=lambda: [weight]),
                               device=torch.device("cpu"), precision=precision)
    return StepContext(pipeline=pipeline, optimizer=optimizer,
                       lr_schedule=build_lr_schedule(optimizer, warmup_steps=3, total_steps=10),
                       scaler=build_grad_scaler(precision, "cpu"), grad_clip=1.0, loss_replicas=1, plane_size=1)


def _step(ctx: StepContext, gradient: float, loss: float):
    (weight,) = ctx.stages.parameters()
    scale = ctx.scaler.get_scale() if ctx.scaler.is_enabled() else 1.0
    weight.grad = torch.full_like(weight, gradient * scale)
    return _optimizer_step(ctx, [torch.tensor(loss * scale)], scale=scale, lr=ctx.optimizer.param_groups[0]["lr"],
                           flags=(False, False))


@pytest.fixture
def world_of_one():
    """fp16's scaler votes on overflow over the world: a gloo group of this one process."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("precision", "gradient", "loss"), [
    ("fp32", float("nan"), 1.0), ("fp32", 1.0, float("inf")), ("bf16", float("inf"), 1.0),
    ("fp16", float("inf"), 1.0)])
def test_a_skipped_step_moves_neither_the_weights_nor_the_lr_schedule(world_of_one, precision, gradient, loss, fused):
    ctx = _context(precision, fused)
    assert not _step(ctx, 0.5, 2.0).skipped  # a good step first: the schedule is past its first warm-up step
    (weight,) = ctx.stages.parameters()
    before, lr, position = weight.detach().clone(), ctx.optimizer.param_groups[0]["lr"], ctx.lr_schedule.last_epoch
    state = {k: v.clone() for k, v in ctx.optimizer.state[weight].items()}
    assert _step(ctx, gradient, loss).skipped
    assert torch.equal(weight, before)
    # AdamW's moments and step count too: a finite gradient with a non-finite loss must not enter them
    assert all(torch.equal(ctx.optimizer.state[weight][k], v) for k, v in state.items())
    assert (ctx.optimizer.param_groups[0]["lr"], ctx.lr_schedule.last_epoch) == (lr, position)
    assert not _step(ctx, 0.5, 2.0).skipped  # the next good step takes the schedule's next rate
    assert ctx.lr_schedule.last_epoch == position + 1 and ctx.optimizer.param_groups[0]["lr"] > lr  # warming up
    assert not torch.equal(weight, before)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_fp8_amax_that_is_not_finite_skips_the_step_with_finite_gradients(world_of_one, precision):
    """--fp8: an inf or NaN amax may leave finite (but wrong) gradients; the guard's vote skips the step anyway."""
    from compiler.fp8 import AmaxGuard

    guard = AmaxGuard()
    ctx = dataclasses.replace(_context(precision, fused=False), fp8_guard=guard)
    guard.observe(torch.tensor([1.0, 2.0]))
    stats = _step(ctx, 0.5, 2.0)
    assert not stats.skipped and not stats.fp8_skipped
    (weight,) = ctx.stages.parameters()
    before, position = weight.detach().clone(), ctx.lr_schedule.last_epoch
    guard.observe(torch.tensor([1.0, float("inf")]))
    guard.observe(torch.tensor([3.0]))  # a later finite amax does not clear it
    stats = _step(ctx, 0.5, 2.0)
    assert stats.skipped and stats.fp8_skipped
    assert torch.equal(weight, before) and ctx.lr_schedule.last_epoch == position
    assert guard.take() is None  # the step took the flag
    assert not _step(ctx, 0.5, 2.0).skipped
