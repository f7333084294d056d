"""Metrics: TensorBoard scalars and text, a progress line, and summary.json, from one logging rank."""

from __future__ import annotations

import datetime
import json
import os
import statistics
from dataclasses import dataclass, field

SCALAR_TAGS = (
    "train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/skipped_steps", "train/fp8_skipped_steps",
    "val/loss",
    "val/perplexity", "data/epoch",
    "perf/step_time_s", "perf/samples_per_sec", "perf/tokens_per_sec", "perf/mfu", "mem/peak_bytes",
)


WARMUP_STEPS = 3  # tracing caches, allocator and p2p warm-up: not steady-state steps


def steady_step_times(step_times: list[float]) -> list[float]:
    """The step times after warm-up (up to ``WARMUP_STEPS``, never more than half of a short run)."""
    return step_times[min(WARMUP_STEPS, len(step_times) // 2):]


@dataclass
class Throughput:
    """Per-step wall times; summary figures use the median after warm-up steps."""

    global_batch_size: int
    seq_len: int
    flops_per_token: float
    peak_flops: float  # whole world, FLOP/s
    step_times: list[float] = field(default_factory=list)

    def samples_per_sec(self, step_time: float) -> float:
        return self.global_batch_size / step_time

    def tokens_per_sec(self, step_time: float) -> float:
        return self.global_batch_size * self.seq_len / step_time

    def mfu(self, step_time: float) -> float:
        return self.tokens_per_sec(step_time) * self.flops_per_token / self.peak_flops

    def steady_step_time(self) -> float:
        """Median step time after warm-up."""
        return statistics.median(steady_step_times(self.step_times))


class MetricsLogger:
    """Writes only on the logging rank; every other rank gets a logger that does nothing."""

    def __init__(self, logdir: str, *, enabled: bool):
        self.logdir, self.enabled, self.writer = logdir, enabled, None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(logdir, exist_ok=True)
            self.writer = SummaryWriter(logdir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, body: str) -> None:
        if self.writer:
            self.writer.add_text(tag, body)

    def image(self, tag: str, image_hwc, step: int = 0) -> None:
        if self.writer:
            self.writer.add_image(tag, image_hwc, step, dataformats="HWC")

    def write_json(self, name: str, payload: dict) -> None:
        if self.enabled:
            with open(os.path.join(self.logdir, name), "w") as f:
                json.dump(payload, f, indent=2, sort_keys=True)

    def close(self) -> None:
        if self.writer:
            self.writer.flush()
            self.writer.close()


def progress_line(*, step: int, steps: int, loss: float, tokens_per_sec: float, mfu: float, loss_scale: float,
                  grad_norm: float, seconds_left: float, epochs: list[float] | None = None,
                  shares: list[float] | None = None) -> str:
    eta = datetime.timedelta(seconds=round(max(0.0, seconds_left)))
    # epochs of each data source completed so far (none for synthetic data); a mixture's realised shares
    epoch = (f" | epoch{'s' if len(epochs) > 1 else ''} {'/'.join(f'{e:.2f}' for e in epochs)}" if epochs else "")
    if shares and len(shares) > 1:
        epoch += f" | shares {'/'.join(f'{x:.3f}' for x in shares)}"
    return (f"step {step:>{len(str(steps))}}/{steps} | loss {loss:.4f}{epoch} | {tokens_per_sec:,.0f} tok/s | "
            f"MFU {100 * mfu:.2f}% | loss scale {loss_scale:g} | grad norm {grad_norm:.3f} | ETA {eta}")
