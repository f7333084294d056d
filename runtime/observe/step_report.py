"""What a training run reports of each step: TensorBoard scalars every step; every ``log_every`` steps the peak
memory, a mixture's tokens per expert and, on the logging rank, the progress line; validation results; and the
figures summary.json keeps. The training loop (runtime/engine/loop.py) calls it and prints nothing itself."""

from __future__ import annotations

import time
from pathlib import Path

from runtime.device import peak_memory_bytes
from runtime.distributed.collectives import max_over_ranks
from runtime.engine.data import DataSources
from runtime.engine.evaluation import language_model_metrics
from runtime.engine.step import StepContext, StepStats
from runtime.observe.metrics import MetricsLogger, Throughput, progress_line


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


class StepReporter:
    """Scalars, progress lines and the per-step figures of one run (``is_logging_rank``: this rank prints)."""

    def __init__(self, *, logger: MetricsLogger, throughput: Throughput, is_logging_rank: bool, log_every: int,
                 steps: int, data: DataSources):
        self.logger, self.throughput, self.is_logging_rank = logger, throughput, is_logging_rank
        self.log_every, self.steps, self.data = log_every, steps, data
        self.losses: list[float] = []
        self.mtp_losses: list[float] = []  # the MTP depths' mean loss per step (runs with --mtp-depth)
        self.grad_norms: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.skipped = 0
        self.fp8_skipped = 0  # of those, skipped for an inf or NaN FP8 amax (--fp8)
        self.expert_loads: dict[int, dict[str, float]] = {}  # step -> max / mean tokens per expert of each MoE layer
        self.peak_by_step: dict[int, float] = {}
        self.started = time.perf_counter()

    def step(self, ctx: StepContext, n: int, stats: StepStats, step_time: float, *, start_step: int,
             last_step: int) -> None:
        """Step ``n`` (1-based) done in ``step_time`` seconds. Every rank calls it: the log steps all-reduce."""
        t = self.throughput
        t.step_times.append(step_time)
        self.losses.append(stats.loss)
        self.grad_norms.append(stats.grad_norm)
        self.skipped += stats.skipped
        self.fp8_skipped += stats.fp8_skipped
        if stats.fp8_skipped:
            self.note(f"step {n}: skipped: an FP8 amax was inf or NaN ({self.fp8_skipped} such step(s) so far)")
        if stats.mtp_loss is not None:
            self.mtp_losses.append(stats.mtp_loss)
        self.logger.scalars(n, {
            "train/loss": stats.loss, "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
            "train/loss_scale": stats.loss_scale, "train/skipped_steps": self.skipped,
            "train/fp8_skipped_steps": self.fp8_skipped,
            "perf/step_time_s": step_time, "perf/samples_per_sec": t.samples_per_sec(step_time),
            "perf/tokens_per_sec": t.tokens_per_sec(step_time), "perf/mfu": t.mfu(step_time),
            **({"train/mtp_loss": stats.mtp_loss} if stats.mtp_loss is not None else {}),
        })
        if n % self.log_every and n != last_step:
            return
        peak = max_over_ranks(peak_memory_bytes(ctx.device), ctx.device)
        self.peak_by_step[n] = peak
        self.logger.scalars(n, {"mem/peak_bytes": peak})
        if ctx.experts is not None:  # every rank: one world all-reduce of the MoE layers' loads
            self._expert_loads(n, ctx.experts.loads())
        if self.is_logging_rank:
            recent = t.step_times[-self.log_every:]
            mean_time = sum(recent) / len(recent)
            elapsed = time.perf_counter() - self.started
            print(progress_line(step=n, steps=self.steps, loss=stats.loss, tokens_per_sec=t.tokens_per_sec(mean_time),
                                mfu=t.mfu(mean_time), loss_scale=stats.loss_scale, grad_norm=stats.grad_norm,
                                seconds_left=elapsed / (n - start_step) * (last_step - n),
                                epochs=self.data.train.epochs(n), shares=self.data.train.shares(n)), flush=True)
        self.logger.scalars(n, data_scalars(self.data, n))

    def _expert_loads(self, n: int, loads: dict[str, float]) -> None:
        self.expert_loads[n] = loads
        self.logger.scalars(n, {f"moe/max_over_mean_load/{name}": v for name, v in loads.items()})
        if self.is_logging_rank:
            print(f"step {n}: tokens per expert, max / mean per MoE layer: "
                  + " ".join(f"{v:.2f}" for v in loads.values()), flush=True)

    def validation(self, n: int, loss: float) -> None:
        self.val_losses.append((n, loss))
        metrics = language_model_metrics(loss, byte_level=self.data.byte_level)
        self.logger.scalars(n, {f"val/{k}": v for k, v in metrics.items()})
        if self.is_logging_rank:
            print(f"step {n}: validation " + " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items()),
                  flush=True)

    def note(self, line: str) -> None:
        if self.is_logging_rank:
            print(line, flush=True)

    def summary(self, *, last_step: int) -> dict:
        """The loop's figures for summary.json."""
        t, val = self.throughput, self.val_losses
        steady = t.steady_step_time()
        return {
            "peak_bytes_by_step": self.peak_by_step,
            "final_loss": self.losses[-1],
            "final_val_loss": val[-1][1] if val else None,
            "final_val": language_model_metrics(val[-1][1], byte_level=self.data.byte_level) if val else None,
            "data": data_summary(self.data, last_step),
            "losses": self.losses,
            "mtp_losses": self.mtp_losses,
            "grad_norms": self.grad_norms,
            "val_losses": val,
            "expert_loads": self.expert_loads,
            "step_times": t.step_times,
            "train_time_s": time.perf_counter() - self.started,  # steps, validation, checkpoint pauses
            "step_time_s": steady,
            "samples_per_sec": t.samples_per_sec(steady),
            "tokens_per_sec": t.tokens_per_sec(steady),
            "mfu": t.mfu(steady),
            "skipped_steps": self.skipped,
            "fp8_skipped_steps": self.fp8_skipped,
        }
