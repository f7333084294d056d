"""Every study run in TensorBoard's HParams tab: what the run was (section, mesh, schedule, batch,
precision) beside what it measured (throughput, MFU, peak memory), so runs of all sections can be
sorted and filtered side by side. Written under DIR/hparams, a TensorBoard run per study run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

# Run metadata (RunSpec.meta) that says what a run was; HParams takes only str, int, float and bool.
HPARAM_KEYS = ("section", "group", "label", "schedule", "kind", "who", "split", "dp", "pp", "mp", "world", "v", "m",
               "micro_batch_size", "precision", "round", "dp_shard", "zero3", "activation_checkpointing", "model")
METRIC_KEYS = ("samples_per_sec", "tokens_per_sec", "mfu", "step_time_s", "peak_bytes", "peak_tensor_bytes")
ENGINE_SECTIONS = ("throughput", "scaling", "overhead", "split", "sharding", "replicate", "zero_bubble")
GIB = 1024**3


@dataclass(frozen=True)
class HParamRun:
    name: str  # the TensorBoard run, under DIR/hparams
    hparams: dict  # what the run was
    metrics: dict[str, float]  # what it measured


def _is_hparam(value) -> bool:
    return isinstance(value, (str, int, float, bool))


def _is_metric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # None (not measured) is left out


def hparam_runs(results: dict) -> list[HParamRun]:
    """The hparams and metrics of every successful run of the sections that ran, memory trials included."""
    runs = []
    for section in ENGINE_SECTIONS:
        for run in results.get(section, {}).get("runs", []):
            if not run.get("ok"):
                continue
            # Every run but the memory trials trains in fp32 (plan._common's default).
            hparams = {"section": section, "precision": "fp32", **{k: run[k] for k in HPARAM_KEYS if _is_hparam(run.get(k))}}
            summary = run.get("summary") or {}
            metrics = {k: float(summary[k]) for k in METRIC_KEYS if _is_metric(summary.get(k))}
            if metrics:
                runs.append(HParamRun(f"{section}/{run['name']}", hparams, metrics))
    for precision, search in (results.get("memory") or {}).get("search", {}).items():
        for trial in search["trials"]:
            if trial.get("ok") and trial.get("peak_gb") is not None:
                metrics = {"peak_tensor_bytes": trial["peak_gb"] * GIB}
                if trial.get("resident_gb") is not None:
                    metrics["peak_bytes"] = trial["resident_gb"] * GIB
                hparams = {"section": "memory", "precision": precision, "micro_batch_size": trial["micro_batch_size"]}
                runs.append(HParamRun(f"memory/{precision}_mbs{trial['micro_batch_size']}", hparams, metrics))
    return runs


def write_hparams(results: dict, out: Path) -> int:
    """Write every run of ``results`` to the HParams tab under out/hparams; returns how many runs it wrote."""
    runs = hparam_runs(results)
    with SummaryWriter(log_dir=str(out / "hparams")) as writer:
        for run in runs:
            writer.add_hparams(run.hparams, run.metrics, run_name=run.name)
    return len(runs)
