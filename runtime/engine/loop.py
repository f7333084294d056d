"""The training loop: data -> step -> guards -> checkpoint, with validation every N steps; what a step reports goes
to its ``StepReporter`` (runtime/observe/step_report.py). A resumed run starts at the checkpoint's step: data and
the LR schedule are functions of the step, so nothing else needs rewinding. A preemption signal on any rank ends
the loop on every rank after the same step, with that step's checkpoint (runtime/engine/preemption.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from runtime.checkpoint.saving import Checkpointer
from runtime.config import DataConfig
from runtime.device import host_to_device, peak_memory_bytes, peak_reserved_bytes
from runtime.distributed.collectives import all_gather_objects, max_over_ranks
from runtime.distributed.timeouts import CHECKPOINT, STARTUP, STEADY, PhaseTimeouts
from runtime.engine.data import DataSources
from runtime.engine.data.inputs import ContextSlice, rank_batch, without_loss_across_documents
from runtime.engine.gc_control import collect_if_due, garbage_collection_between_steps
from runtime.engine.guards import DivergenceGuard
from runtime.engine.preemption import StopRequest
from runtime.engine.step import StepContext, StepStats, evaluate, timed, train_step
from runtime.observe.memory import live_tensor_bytes, peak_growth_during, step_state_tensors
from runtime.observe.profiling import Profiler
from runtime.observe.step_report import StepReporter


@contextlib.contextmanager
def _noting_the_step(current: Callable[[], int]) -> Iterator[None]:
    """Tag an error escaping the loop with the step it happened in (a lost peer's error line names it)."""
    try:
        yield
    except RuntimeError as e:
        e.add_note(f"step {current()}")
        raise


@dataclass(frozen=True)
class Batches:
    """This rank's (inputs, targets) of a step, on its device: its replica's rows, its context chunks."""

    data: DataSources
    data_cfg: DataConfig
    replica_rows: tuple[int, int]
    device: torch.device
    context: ContextSlice | None = None
    mtp_depth: int = 0  # the targets carry the MTP depths' (runtime/engine/data/future_tokens.py)

    def of(self, source, step: int):
        cfg = self.data_cfg
        inputs, targets = rank_batch(source, step, self.replica_rows, document_mask=cfg.document_mask,
                                     context=self.context, mtp_depth=self.mtp_depth)
        if cfg.no_loss_across_documents:
            targets = without_loss_across_documents(inputs, targets, cfg.eod_token, mtp_depth=self.mtp_depth)
        inputs = (tuple(host_to_device(t, self.device) for t in inputs) if isinstance(inputs, tuple)
                  else host_to_device(inputs, self.device))
        return inputs, host_to_device(targets, self.device)

    def validation(self) -> list:
        return [self.of(self.data.val, i) for i in range(self.data_cfg.eval_batches)] if self.data_cfg.eval_every else []

    def trained_tokens(self, source, step: int) -> int | None:
        """Chat data: global batch ``step``'s count of trained targets (runtime/engine/token_mean.py); else None."""
        return source.trained_targets(step) if self.data.chat else None

    def validation_tokens(self) -> list[int] | None:
        return [self.trained_tokens(self.data.val, i) for i in range(self.data_cfg.eval_batches)] if self.data.chat else None


@dataclass
class TrainingLoop:
    """One run's steps from ``start_step`` to ``last_step``. ``phases``: the first step of this process (and its
    first validation: new graphs to trace or compile) runs in start-up, later ones in steady steps, checkpoint
    saves in checkpoint I/O, each bounded by its own timeout."""

    ctx: StepContext
    batches: Batches
    reporter: StepReporter
    guard: DivergenceGuard
    phases: PhaseTimeouts
    checkpointer: Checkpointer | None = None
    profiler: Profiler | None = None
    stop: StopRequest | None = None
    profile_memory: bool = False  # measure the peak tensor memory of the second step

    def run(self, *, start_step: int, last_step: int) -> dict:
        val_batches, val_tokens = self.batches.validation(), self.batches.validation_tokens()
        # The second step is the first to hold AdamW's state alongside activations and gradients.
        memory_step = start_step + min(1, last_step - start_step - 1) if self.profile_memory else None
        peak_tensor_bytes, preempted_at, step = None, None, start_step
        with garbage_collection_between_steps(), _noting_the_step(lambda: step + 1):
            for step in range(start_step, last_step):
                stats, step_time, measured = self._step(step, measure_memory=step == memory_step)
                peak_tensor_bytes = measured or peak_tensor_bytes
                if step == start_step:
                    self.phases.switch(STEADY)
                n = step + 1
                self.reporter.step(self.ctx, n, stats, step_time, start_step=start_step, last_step=last_step)
                # Raises DivergenceError on every rank alike, before any checkpoint of this step is written.
                self.guard.observe(n, loss=stats.loss, grad_norm=stats.grad_norm, skipped=stats.skipped,
                                   loss_scale=self._loss_scale())
                cfg = self.batches.data_cfg
                if cfg.eval_every and (n % cfg.eval_every == 0 or n == last_step):
                    self._validate(n, val_batches, val_tokens)
                self._checkpoint(n, stats, last=n == last_step)
                if stats.stop:  # every rank saw the same all-reduced flag
                    preempted_at = n
                    self.reporter.note(f"step {n}: stopping on a preemption signal" + (
                        "; checkpoint saved, --resume continues" if self.checkpointer else " (no --checkpoint-dir)"))
                    break
                collect_if_due(n)
            if self.checkpointer:
                with self.phases.during(CHECKPOINT):
                    self.checkpointer.finish()  # a background save still in flight (the last step's was not trustworthy)
        return self._summary(start_step=start_step, last_step=preempted_at or last_step, preempted_at=preempted_at,
                             peak_tensor_bytes=peak_tensor_bytes)

    def _step(self, step: int, *, measure_memory: bool) -> tuple[StepStats, float, float | None]:
        """Train one step: (stats, seconds, peak tensor bytes over the ranks when ``measure_memory``)."""
        ctx, checkpointer = self.ctx, self.checkpointer
        inputs, targets = self.batches.of(self.batches.data.train, step)
        trained = self.batches.trained_tokens(self.batches.data.train, step)
        profiling = self.profiler is not None and self.profiler.wants(step)
        if profiling:
            self.profiler.begin()
        run_step = lambda: train_step(ctx, inputs, targets, stop_requested=bool(self.stop and self.stop.requested),  # noqa: E731
                                      writing=bool(checkpointer and checkpointer.writing), trained_tokens=trained)
        peak = None
        if measure_memory:
            live = live_tensor_bytes([*step_state_tensors(ctx.stages.parameters(), ctx.optimizer), inputs, targets])
            (stats, step_time), growth = peak_growth_during(lambda: timed(run_step, ctx.device), ctx.device)
            peak = max_over_ranks(live + growth, ctx.device)
            self.reporter.logger.scalars(step + 1, {"mem/peak_tensor_bytes": peak})
        else:
            stats, step_time = timed(run_step, ctx.device)
        if profiling:
            self.profiler.end()
        return stats, step_time, peak

    def _loss_scale(self) -> float:
        scaler = self.ctx.scaler
        return scaler.get_scale() if scaler.is_enabled() else 1.0

    def _validate(self, n: int, val_batches: list, val_tokens: list[int] | None) -> None:
        first = not self.reporter.val_losses
        with self.phases.during(STARTUP) if first else contextlib.nullcontext():
            self.reporter.validation(n, evaluate(self.ctx, val_batches, val_tokens))

    def _checkpoint(self, n: int, stats: StepStats, *, last: bool) -> None:
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        if checkpointer.pending and not stats.writing:
            with self.phases.during(CHECKPOINT):
                checkpointer.finish()  # every rank's background write is done: publish it
        if checkpointer.due(n, last=last or stats.stop):
            if self.guard.weights_trustworthy:
                with self.phases.during(CHECKPOINT):
                    checkpointer.save(n, wait=last or stats.stop)
            else:
                self.reporter.note(f"step {n}: not saving a checkpoint: the loss or gradient norm is not finite")

    def _summary(self, *, start_step: int, last_step: int, preempted_at: int | None,
                 peak_tensor_bytes: float | None) -> dict:
        memory = all_gather_objects((peak_memory_bytes(self.ctx.device), peak_reserved_bytes(self.ctx.device)))
        checkpointer = self.checkpointer
        return {
            "start_step": start_step,
            "last_step": last_step,
            "preempted_at": preempted_at,
            "checkpoints": checkpointer.saved if checkpointer else [],
            "checkpoint_pauses_s": checkpointer.pauses if checkpointer else {},
            **self.reporter.summary(last_step=last_step),
            "peak_bytes": max(peak for peak, _ in memory),
            "peak_bytes_per_rank": [peak for peak, _ in memory],
            "peak_reserved_bytes_per_rank": [reserved for _, reserved in memory],  # None on the CPU
            "peak_tensor_bytes": peak_tensor_bytes,
            "final_loss_scale": self._loss_scale(),
        }
