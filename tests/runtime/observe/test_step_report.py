"""runtime/observe/step_report.py: a step skipped for an inf or NaN FP8 amax is counted apart from the other skips,
in TensorBoard (``train/fp8_skipped_steps``), in the log (a line naming the step) and in summary.json."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.engine.step import StepStats
from runtime.observe.metrics import Throughput
from runtime.observe.step_report import StepReporter


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.logged.setdefault(step, {}).update(values)


def test_fp8_skips_are_counted_logged_and_summarised(capsys):
    logger = RecordingLogger()
    train = SimpleNamespace(epochs=lambda steps: [0.0], shares=lambda steps: [1.0], components=[])
    reporter = StepReporter(logger=logger, throughput=Throughput(4, 32, 1e6, 1e12), is_logging_rank=True,
                            log_every=100, steps=10, data=SimpleNamespace(train=train, byte_level=True))
    stats = [StepStats(loss=2.0, grad_norm=1.0, loss_scale=1.0, skipped=False, lr=1e-3),
             StepStats(loss=2.0, grad_norm=1.0, loss_scale=1.0, skipped=True, lr=1e-3, fp8_skipped=True),
             StepStats(loss=float("nan"), grad_norm=1.0, loss_scale=1.0, skipped=True, lr=1e-3)]
    for n, s in enumerate(stats, 1):
        reporter.step(None, n, s, 0.1, start_step=0, last_step=10)
    assert [logger.logged[n]["train/fp8_skipped_steps"] for n in (1, 2, 3)] == [0, 1, 1]
    assert [logger.logged[n]["train/skipped_steps"] for n in (1, 2, 3)] == [0, 1, 2]
    assert "step 2: skipped: an FP8 amax was inf or NaN" in capsys.readouterr().out
    summary = reporter.summary(last_step=3)
    assert (summary["skipped_steps"], summary["fp8_skipped_steps"]) == (2, 1)
