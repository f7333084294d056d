"""One training step, and validation through the same pipeline.

A step on every rank: run the pipeline schedule on this replica's micro-batches (under autocast),
unscale fp16 gradients (world-wide found-inf vote), one world all-reduce of [grad-norm^2, loss, stop
requested, ranks still writing a background checkpoint, ranks whose FP8 amaxes were not finite] (the stop and
writing flags: runtime/engine/preemption.py, runtime/checkpoint/saving.py; the FP8 guard: compiler/fp8/guard.py),
clip to the global norm, optimizer step (skipped together on fp16 overflow, on a non-finite FP8 amax anywhere, or
on a non-finite loss or norm otherwise), scale update, LR step (not after a skipped step).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from compiler.fp8 import AmaxGuard
from compiler.parallelize.float8 import Fp8AllGatherAmaxes
from compiler.parallelize.stages import LocalStages
from compiler.schedules import evaluation_pass
from runtime.device import synchronize
from runtime.engine.amp import autocast, ensure_scale_initialised, loss_value
from runtime.engine.experts import ExpertBalance
from runtime.engine.grad_clip import clip_grads_, local_grad_sq_norm
from runtime.engine.grad_layout import restore_gradient_layouts
from runtime.engine.mtp_loss import MtpObjective
from runtime.engine.partial_grads import sum_partial_gradients
from runtime.engine.replicate import ReplicatedGradients
from runtime.engine.tied import TiedWeights
from runtime.engine.token_mean import TrainedTokens
from runtime.observe.profiling import StepRecorder


@dataclass(frozen=True)
class StepStats:
    loss: float  # mean next-token loss over the global batch (unscaled)
    grad_norm: float  # global L2 norm before clipping
    loss_scale: float  # fp16 loss scale used for this step (1.0 when disabled)
    skipped: bool  # optimizer step skipped: fp16 overflow, or a non-finite loss / gradient norm
    lr: float
    stop: bool = False  # some rank asked to stop (a preemption signal) before this step's all-reduce
    writing: bool = False  # some rank was still writing a background checkpoint at this step's all-reduce
    fp8_skipped: bool = False  # skipped because some rank's FP8 amax was inf or NaN (--fp8)
    mtp_loss: float | None = None  # the MTP depths' mean loss over the global batch (``loss`` includes its weight)


@dataclass(frozen=True)
class PipelineContext:
    """What a pass through this rank's stages needs, training or evaluating: the schedule over the stages (its loss
    function decides what a micro-batch reports), and the gradient bookkeeping a training pass does after it."""

    schedule: object
    schedule_name: str  # its --schedule name (compiler/schedules.py), for the evaluation pass
    stages: LocalStages
    device: torch.device
    precision: str
    tied: TiedWeights | None = None  # the tied embedding / head copies this rank holds
    replicated: ReplicatedGradients | None = None  # replicated data parallelism: averages gradients over dp
    recorder: StepRecorder | None = None  # set when profiling: times the gradient and optimizer phases


@dataclass(frozen=True)
class StepContext:
    """What a training step needs besides its data; built once."""

    pipeline: PipelineContext
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: ShardedGradScaler
    grad_clip: float
    loss_replicas: int  # ranks each reporting the mean loss of an equal share of the batch: dp x cp x mp
    plane_size: int  # dp x cp x mp: ranks sharing one pipeline stage
    microbatches: int = 1  # m per replica and step
    experts: ExpertBalance | None = None  # a mixture-of-experts model's per-step bookkeeping (runtime/engine/experts.py)
    trained_tokens: TrainedTokens | None = None  # chat data: the loss's global count of trained targets (token_mean.py)
    fp8_guard: AmaxGuard | None = None  # --fp8: set when an amax of this rank's step was inf or NaN
    fp8_amaxes: Fp8AllGatherAmaxes | None = None  # --fp8-all-gather: the weights' whole amaxes, once per step
    mtp_depth: int = 0  # multi-token-prediction depths (a run with them reports their loss)
    mtp: MtpObjective | None = None  # their objective, on a rank holding the last stage (runtime/engine/mtp_loss.py)

    @property
    def device(self) -> torch.device:
        return self.pipeline.device

    @property
    def stages(self) -> LocalStages:
        return self.pipeline.stages


def run_schedule(ctx: PipelineContext, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor, *,
                 train: bool) -> list[torch.Tensor]:
    """Run one pass of the schedule over this replica's batch (training: forward and backward of every
    micro-batch, tied copies' gradients summed, replicas' gradients averaged where nothing is sharded);
    returns per-micro-batch losses on the last stage. ``inputs``: tokens (B, T), or (tokens, positions) for
    packed documents."""
    losses: list[torch.Tensor] = []
    args = (inputs if isinstance(inputs, tuple) else (inputs,)) if ctx.stages.has_first else ()
    kwargs = {"target": targets, "losses": losses} if ctx.stages.has_last else {}
    with autocast(ctx.device.type, ctx.precision):
        if train:
            # return_outputs=False: do not keep and concatenate every micro-batch's logits (B, T, V).
            ctx.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            with torch.no_grad(), evaluation_pass(ctx.schedule_name, ctx.schedule):
                ctx.schedule.eval(*args, **kwargs)
    if train:
        with ctx.recorder.span("dp_comm", "gradient all-reduce") if ctx.recorder else contextlib.nullcontext():
            if ctx.tied is not None:
                ctx.tied.sync_grads()
            if ctx.replicated is not None:
                ctx.replicated.finish()
            if ctx.stages.gradient_factors:
                scale_reduced_gradients(ctx.stages.parameters(), ctx.stages.gradient_factors)
            sum_partial_gradients(ctx.stages.parameters())  # SP's norm gradients where no FSDP reduced them
            restore_gradient_layouts(ctx.stages.parameters())  # what zero-bubble W passes assigned, for fused AdamW
    return losses


def scale_reduced_gradients(params: list[torch.nn.Parameter], factors: dict[int, float]) -> None:
    """Multiply each reduced gradient by its factor (compiler/parallelize/data_parallel.py moe_gradient_factors:
    a mixture's FSDP units divide by their mesh's size, the mean loss by dp x cp)."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None and id(p) in factors:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(factors[id(p)])


def train_step(ctx: StepContext, inputs: torch.Tensor, targets: torch.Tensor, *, stop_requested: bool = False,
               writing: bool = False, trained_tokens: int | None = None) -> StepStats:
    """``trained_tokens``: chat data's count of trained targets in the global batch (runtime/engine/token_mean.py)."""
    _set_trained_tokens(ctx, trained_tokens)
    scale = ctx.scaler.get_scale() if ctx.scaler.is_enabled() else 1.0
    lr = ctx.optimizer.param_groups[0]["lr"]
    if ctx.experts is not None:
        ctx.experts.before_step(loss_scale=scale, microbatches=ctx.microbatches)
    if ctx.fp8_guard is not None:
        ctx.fp8_guard.take()  # what validation's forwards saw is not this step's
    if ctx.fp8_amaxes is not None:
        ctx.fp8_amaxes.before_step()  # before any gather: every micro-batch's (and ZeRO-3's re-gathers') one scale
    losses = forward_backward(ctx, inputs, targets)

    recorder = ctx.pipeline.recorder
    with recorder.span("optimizer", "optimizer") if recorder else contextlib.nullcontext():
        stats = _optimizer_step(ctx, losses, scale=scale, lr=lr, flags=(stop_requested, writing))
    if ctx.fp8_amaxes is not None:
        ctx.fp8_amaxes.after_step()  # the weights changed: validation's gathers reduce their amaxes anew
    return stats


def forward_backward(ctx: StepContext, inputs: torch.Tensor | tuple[torch.Tensor, ...],
                     targets: torch.Tensor) -> list[torch.Tensor]:
    """The step's forward and backward of every micro-batch (tests reach into a step after it: tests/step_hook.py)."""
    return run_schedule(ctx.pipeline, inputs, targets, train=True)


def _optimizer_step(ctx: StepContext, losses: list[torch.Tensor], *, scale: float, lr: float,
                    flags: tuple[bool, bool]) -> StepStats:
    ensure_scale_initialised(ctx.scaler, ctx.device)
    ctx.scaler.unscale_(ctx.optimizer)  # all-reduces found_inf over the world
    params = ctx.stages.parameters()
    # A tied weight's second copy holds the same gradient: the norm counts the weight once.
    tied = ctx.pipeline.tied
    distinct = [p for p in params if id(p) not in tied.duplicates] if tied else params
    local_loss = loss_value(losses, scale=scale) if losses else torch.zeros((), dtype=torch.float64)
    # (stop requested, still writing, an FP8 amax not finite): summed, so > 0 means "on some rank"
    fp8_found = ctx.fp8_guard.take() if ctx.fp8_guard is not None else None
    flag_values = torch.tensor([float(f) for f in flags] + [0.0], dtype=torch.float64, device=ctx.device)
    if fp8_found is not None:
        flag_values[2] = fp8_found.to(ctx.device, torch.float64)
    # A run with MTP depths adds their loss (zero where this rank has no last stage: every rank sends one size)
    local_mtp = ctx.mtp.take_mean() if ctx.mtp is not None else None
    mtp = [(local_mtp if local_mtp is not None else torch.zeros(1, dtype=torch.float64)).reshape(1).to(ctx.device)]
    packed = torch.cat([torch.stack([local_grad_sq_norm(distinct, plane_size=ctx.plane_size), local_loss.to(ctx.device)]),
                        flag_values, *(mtp if ctx.mtp_depth else [])])
    if dist.is_initialized():
        dist.all_reduce(packed)
    grad_norm = float(packed[0].sqrt())
    loss = float(packed[1]) / ctx.loss_replicas
    stop_anywhere, writing_anywhere, fp8_bad = bool(packed[2] > 0), bool(packed[3] > 0), bool(packed[4] > 0)
    clip_grads_(params, max_norm=ctx.grad_clip, total_norm=grad_norm)

    if fp8_bad:
        # A scale from an inf or NaN amax quantized a whole block to zeros or NaN: the gradients may look finite and
        # still be wrong. Every rank saw the same vote and skips this update, as an fp16 overflow is skipped.
        skipped = True
        if ctx.scaler.is_enabled():
            ctx.scaler.update()  # the scale follows its own found-inf vote
    elif ctx.scaler.is_enabled():
        ctx.scaler.step(ctx.optimizer)  # skipped on every rank if any rank found inf/nan
        ctx.scaler.update()
        skipped = ctx.scaler.get_scale() < scale
    else:
        # fp32 / bf16: a non-finite loss or norm would write NaN into every weight. Every rank sees the
        # same all-reduced values, so all skip together; runtime/guards.py stops a run of such steps.
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
        if not skipped:
            ctx.optimizer.step()
    if ctx.experts is not None:  # tokens per expert of the step; the selection bias after the optimizer step
        ctx.experts.after_step(update_bias=not skipped)
    # A skipped step changed no weight, so the schedule does not move either (Megatron-LM steps its
    # scheduler only after a successful update): the run trains its --steps updates at the rates planned.
    if not skipped:
        ctx.lr_schedule.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return StepStats(loss=loss, grad_norm=grad_norm, loss_scale=scale, skipped=skipped, lr=lr, stop=stop_anywhere,
                     writing=writing_anywhere, fp8_skipped=fp8_bad,
                     mtp_loss=float(packed[5]) / ctx.loss_replicas if ctx.mtp_depth else None)


def _set_trained_tokens(ctx: StepContext, count: int | None) -> None:
    if (ctx.trained_tokens is None) != (count is None):
        raise ValueError("chat data's loss needs each batch's count of trained targets, and only chat data's loss takes one")
    if ctx.trained_tokens is not None:
        ctx.trained_tokens.set(count)


def evaluate(ctx: StepContext, batches: list[tuple[torch.Tensor, torch.Tensor]],
             trained_tokens: list[int] | None = None) -> float:
    """Mean validation loss over the given replica batches (forward only, through the same pipeline); chat data:
    the mean of each batch's mean over its ``trained_tokens``."""
    scale = ctx.scaler.get_scale() if ctx.scaler.is_enabled() else 1.0
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for i, (inputs, targets) in enumerate(batches):
        _set_trained_tokens(ctx, trained_tokens[i] if trained_tokens is not None else None)
        losses = run_schedule(ctx.pipeline, inputs, targets, train=False)
        if losses:
            total += loss_value(losses, scale=scale).to(ctx.device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total) / (ctx.loss_replicas * len(batches))


def timed(fn: Callable[[], StepStats], device: torch.device) -> tuple[StepStats, float]:
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start
