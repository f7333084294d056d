"""The training loop: data -> step -> metrics -> divergence guard -> checkpoint, with validation every N
steps and a summary at the end. A resumed run starts at the checkpoint's step: data and the LR schedule
are functions of the step, so nothing else needs rewinding. A preemption signal on any rank ends the
loop on every rank after the same step, with that step's checkpoint (runtime/engine/preemption.py)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

from runtime.checkpoint.saving import Checkpointer
from runtime.config import DataConfig, MetricsConfig, OptimConfig
from runtime.device import host_to_device, peak_memory_bytes, peak_reserved_bytes
from runtime.distributed.collectives import all_gather_objects, max_over_ranks
from runtime.distributed.timeouts import CHECKPOINT, STARTUP, STEADY, PhaseTimeouts
from runtime.engine.data import DataSources
from runtime.engine.data.inputs import ContextSlice, rank_batch, without_loss_across_documents
from runtime.engine.evaluation import language_model_metrics
from runtime.engine.gc_control import collect_if_due, garbage_collection_between_steps
from runtime.engine.guards import DivergenceGuard
from runtime.engine.preemption import StopRequest
from runtime.engine.step import StepContext, evaluate, timed, train_step
from runtime.observe.memory import live_tensor_bytes, peak_growth_during, step_state_tensors
from runtime.observe.metrics import MetricsLogger, Throughput, progress_line
from runtime.observe.profiling import Profiler


@contextlib.contextmanager
def _noting_the_step(current: Callable[[], int]) -> Iterator[None]:
    """Tag an error escaping the loop with the step it happened in (a lost peer's error line names it)."""
    try:
        yield
    except RuntimeError as e:
        e.add_note(f"step {current()}")
        raise


def data_scalars(data: DataSources, steps: int) -> dict[str, float]:
    """Epochs completed (``data/epoch``) and, for a mixture, each source's epochs and realised share."""
    epochs, shares = data.train.epochs(steps), data.train.shares(steps)
    if len(epochs) <= 1:
        return {"data/epoch": epochs[0]} if epochs else {}
    out = {"data/epoch": min(epochs)}
    for k, (name, e, share) in enumerate(zip(data.names, epochs, shares)):
        tag = f"{k}_{Path(name).name}"
        out.update({f"data/epoch/{tag}": e, f"data/share/{tag}": share})
    return out


def data_summary(data: DataSources, steps: int) -> dict:
    """What summary.json says of the data: each source's weight, realised share and epochs."""
    components = data.train.components
    return {"sources": [{"data": c.name, "weight": float(c.weight), "share": share, "epochs": epochs,
                         "windows": c.corpus.windows}
                        for c, share, epochs in zip(components, data.train.shares(steps), data.train.epochs(steps))],
            "byte_level": data.byte_level}


def training_loop(
    ctx: StepContext,
    *,
    data: DataSources,
    replica_rows: tuple[int, int],
    optim: OptimConfig,
    data_cfg: DataConfig,
    metrics_cfg: MetricsConfig,
    throughput: Throughput,
    logger: MetricsLogger,
    is_logging_rank: bool,
    guard: DivergenceGuard,
    start_step: int = 0,
    checkpointer: Checkpointer | None = None,
    profiler: Profiler | None = None,
    stop: StopRequest | None = None,
    context: ContextSlice | None = None,
    phases: PhaseTimeouts,
) -> dict:
    """Train from ``start_step`` to ``optim.last_step``. ``phases``: the first step of this process (and its
    first validation: new graphs to trace or compile) runs in start-up, the later ones in steady steps, and
    checkpoint saves in checkpoint I/O, each bounded by its own timeout."""
    def batch(source, step):
        inputs, targets = rank_batch(source, step, replica_rows, document_mask=data_cfg.document_mask, context=context)
        if data_cfg.no_loss_across_documents:
            targets = without_loss_across_documents(inputs, targets, data_cfg.eod_token)
        inputs = tuple(host_to_device(t, ctx.device) for t in inputs) if isinstance(inputs, tuple) else host_to_device(inputs, ctx.device)
        return inputs, host_to_device(targets, ctx.device)

    val_batches = [batch(data.val, i) for i in range(data_cfg.eval_batches)] if data_cfg.eval_every else []
    losses, grad_norms, val_losses, skipped = [], [], [], 0
    expert_loads: dict[int, dict[str, float]] = {}  # step -> max / mean tokens per expert of each MoE layer
    last_step = optim.last_step  # --stop-at-step, else --steps
    # The second step is the first to hold AdamW's state alongside activations and gradients.
    memory_step = start_step + min(1, last_step - start_step - 1) if metrics_cfg.profile_memory else None
    peak_tensor_bytes, preempted_at, peak_by_step = None, None, {}
    started = time.perf_counter()
    step = start_step
    with garbage_collection_between_steps(), _noting_the_step(lambda: step + 1):
        for step in range(start_step, last_step):
            inputs, targets = batch(data.train, step)
            profiling = profiler is not None and profiler.wants(step)
            if profiling:
                profiler.begin()
            run_step = lambda: train_step(ctx, inputs, targets, stop_requested=bool(stop and stop.requested),  # noqa: E731
                                          writing=bool(checkpointer and checkpointer.writing))
            if step == memory_step:
                live = live_tensor_bytes([*step_state_tensors(ctx.stages.parameters(), ctx.optimizer), inputs, targets])
                (stats, step_time), growth = peak_growth_during(lambda: timed(run_step, ctx.device), ctx.device)
                peak_tensor_bytes = max_over_ranks(live + growth, ctx.device)
                logger.scalars(step + 1, {"mem/peak_tensor_bytes": peak_tensor_bytes})
            else:
                stats, step_time = timed(run_step, ctx.device)
            if step == start_step:
                phases.switch(STEADY)
            if profiling:
                profiler.end()
            throughput.step_times.append(step_time)
            losses.append(stats.loss)
            grad_norms.append(stats.grad_norm)
            skipped += stats.skipped
            n = step + 1
            logger.scalars(n, {
                "train/loss": stats.loss, "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
                "train/loss_scale": stats.loss_scale, "train/skipped_steps": skipped,
                "perf/step_time_s": step_time, "perf/samples_per_sec": throughput.samples_per_sec(step_time),
                "perf/tokens_per_sec": throughput.tokens_per_sec(step_time), "perf/mfu": throughput.mfu(step_time),
            })
            if n % metrics_cfg.log_every == 0 or n == last_step:
                peak = max_over_ranks(peak_memory_bytes(ctx.device), ctx.device)
                peak_by_step[n] = peak
                logger.scalars(n, {"mem/peak_bytes": peak})
                if ctx.experts is not None:  # every rank: one world all-reduce of the MoE layers' loads
                    loads = ctx.experts.loads()
                    expert_loads[n] = loads
                    logger.scalars(n, {f"moe/max_over_mean_load/{name}": v for name, v in loads.items()})
                    if is_logging_rank:
                        print(f"step {n}: tokens per expert, max / mean per MoE layer: "
                              + " ".join(f"{v:.2f}" for v in loads.values()), flush=True)
                if is_logging_rank:
                    recent = throughput.step_times[-metrics_cfg.log_every:]
                    mean_time = sum(recent) / len(recent)
                    elapsed = time.perf_counter() - started
                    print(progress_line(step=n, steps=optim.steps, loss=stats.loss,
                                        tokens_per_sec=throughput.tokens_per_sec(mean_time),
                                        mfu=throughput.mfu(mean_time), loss_scale=stats.loss_scale,
                                        grad_norm=stats.grad_norm,
                                        seconds_left=elapsed / (n - start_step) * (last_step - n),
                                        epochs=data.train.epochs(n), shares=data.train.shares(n)), flush=True)
                logger.scalars(n, data_scalars(data, n))
            # Raises DivergenceError on every rank alike, before any checkpoint of this step is written.
            guard.observe(n, loss=stats.loss, grad_norm=stats.grad_norm, skipped=stats.skipped,
                          loss_scale=ctx.scaler.get_scale() if ctx.scaler.is_enabled() else 1.0)
            if data_cfg.eval_every and (n % data_cfg.eval_every == 0 or n == last_step):
                with phases.during(STARTUP) if not val_losses else contextlib.nullcontext():
                    val = evaluate(ctx, val_batches)
                val_losses.append((n, val))
                val_metrics = language_model_metrics(val, byte_level=data.byte_level)
                logger.scalars(n, {f"val/{k}": v for k, v in val_metrics.items()})
                if is_logging_rank:
                    print(f"step {n}: validation " + " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in val_metrics.items()),
                          flush=True)
            if checkpointer and checkpointer.pending and not stats.writing:
                with phases.during(CHECKPOINT):
                    checkpointer.finish()  # every rank's background write is done: publish it
            if checkpointer and checkpointer.due(n, last=n == last_step or stats.stop):
                if guard.weights_trustworthy:
                    with phases.during(CHECKPOINT):
                        checkpointer.save(n, wait=n == last_step or stats.stop)
                elif is_logging_rank:
                    print(f"step {n}: not saving a checkpoint: the loss or gradient norm is not finite", flush=True)
            if stats.stop:  # every rank saw the same all-reduced flag
                preempted_at = n
                if is_logging_rank:
                    print(f"step {n}: stopping on a preemption signal"
                          + ("; checkpoint saved, --resume continues" if checkpointer else " (no --checkpoint-dir)"),
                          flush=True)
                break
            collect_if_due(n)
        if checkpointer:
            with phases.during(CHECKPOINT):
                checkpointer.finish()  # a background save still in flight (the last step's was not trustworthy)

    steady = throughput.steady_step_time()
    memory = all_gather_objects((peak_memory_bytes(ctx.device), peak_reserved_bytes(ctx.device)))
    return {
        "start_step": start_step,
        "last_step": preempted_at or last_step,
        "preempted_at": preempted_at,
        "checkpoints": checkpointer.saved if checkpointer else [],
        "checkpoint_pauses_s": checkpointer.pauses if checkpointer else {},
        "peak_bytes_by_step": peak_by_step,
        "final_loss": losses[-1],
        "final_val_loss": val_losses[-1][1] if val_losses else None,
        "final_val": language_model_metrics(val_losses[-1][1], byte_level=data.byte_level) if val_losses else None,
        "data": data_summary(data, preempted_at or last_step),
        "losses": losses,
        "grad_norms": grad_norms,
        "val_losses": val_losses,
        "expert_loads": expert_loads,
        "step_times": throughput.step_times,
        "train_time_s": time.perf_counter() - started,  # the loop's wall time: steps, validation, checkpoint pauses
        "step_time_s": steady,
        "samples_per_sec": throughput.samples_per_sec(steady),
        "tokens_per_sec": throughput.tokens_per_sec(steady),
        "mfu": throughput.mfu(steady),
        "peak_bytes": max(peak for peak, _ in memory),
        "peak_bytes_per_rank": [peak for peak, _ in memory],
        "peak_reserved_bytes_per_rank": [reserved for _, reserved in memory],  # None on the CPU
        "peak_tensor_bytes": peak_tensor_bytes,
        "skipped_steps": skipped,
        "final_loss_scale": ctx.scaler.get_scale() if ctx.scaler.is_enabled() else 1.0,
    }
