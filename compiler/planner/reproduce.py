"""Published large-scale runs priced by the cost model (compiler/published/*.json), and the one constant
fitted to them.

A file names its source, the cluster preset it ran on, the engine that ran it (compiler/planner/engines.py),
the metric it reports and, per row, the model, GPUs, sequence, global batch, the layout the source states
(dp, pp, mp, cp, ep, micro-batch, schedule, v, checkpointing, DP mode, SP) and the reported figure (and
peak memory where given; a MoE row's ``dispatcher``). Each row is priced as the best plan within what the
source states: what it leaves open is searched. ``fitted`` marks the files a constant was fitted to
(in-sample): Megatron-LM's Table 1 (Narayanan et al. SC'21) for the GEMM efficiency's ``max_efficiency``;
every other file is out of sample. Features a row used that the model does not describe are listed in its
``unmodelled`` (torch.compile, async TP): their rows are reported apart as well.

Metrics: ``hardware_tflops_per_gpu`` (Megatron's count with the recompute, shape.hardware_flops_per_token),
``model_tflops_per_gpu`` (PaLM's 6N + 12 L T d), ``tokens_per_s_per_gpu`` and ``step_time_s``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from compiler.planner.candidates import Constraints
from compiler.planner.cluster import Cluster, load_cluster
from compiler.planner.devices import GemmEfficiency
from compiler.planner.engines import ENGINES, EP_DISPATCHES, EngineTraits
from compiler.planner.search import Estimate, search
from compiler.planner.shape import DecoderShape, hardware_flops_per_token
from models import named_config
from models.spec import Experts

PUBLISHED_DIR = Path(__file__).resolve().parent.parent / "published"
LAYOUT_KEYS = {"dp": "dp", "pp": "pp", "mp": "mp", "cp": "cp", "ep": "ep", "micro_batch_size": "micro_batch_size",
               "schedule": "schedule", "stages_per_rank": "stages_per_rank", "ac": "ac", "dp_mode": "dp_mode",
               "sequence_parallel": "sequence_parallel"}


@dataclass(frozen=True)
class PublishedRun:
    label: str
    shape: DecoderShape
    gpus: int
    global_batch: int  # sequences per step
    layout: Constraints  # what the source states
    reported: float
    memory_gib: float | None = None
    float8: bool = False
    dispatcher: str = "all-to-all"  # how MoE tokens travel (engines.py ``ep_dispatch``): "all-to-all" | "deepep"
    unmodelled: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class PublishedTable:
    name: str
    source: str
    cluster: str
    engine: EngineTraits
    precision: str
    metric: str
    fitted: bool
    runs: list[PublishedRun]


def _shape(spec: dict | str, seq_len: int) -> DecoderShape:
    """A model of the registry by name, or explicit sizes (``run.py plan``'s shape flags as JSON keys)."""
    if isinstance(spec, str):
        return DecoderShape.from_config(named_config(spec, seq_len=seq_len))
    d = dict(spec)
    experts = Experts(**d.pop("experts")) if "experts" in d else None
    positions = d.pop("positions", None)
    shape = DecoderShape.from_flags(seq_len=seq_len, experts=experts, **d)
    return replace(shape, positions=positions) if positions else shape


def _columns_table(data: dict) -> PublishedTable:
    """The SC'21 Table 1 file (columns, rows, setup)."""
    setup = data["setup"]
    seq_len, vocab = int(setup["seq_len"]), int(setup["vocab"])
    runs = []
    for values in data["rows"]:
        row = dict(zip(data["columns"], values))
        shape = DecoderShape.from_flags(layers=int(row["layers"]), d_model=int(row["hidden"]), heads=int(row["heads"]),
                                        seq_len=seq_len, vocab_size=vocab)
        dp = int(row["gpus"]) // (int(row["tp"]) * int(row["pp"]))
        layout = Constraints(dp=dp, pp=int(row["pp"]), mp=int(row["tp"]), cp=1, ac="full",
                             schedule=("1f1b", "interleaved-1f1b"))
        runs.append(PublishedRun(f"{row['params_billion']}B", shape, int(row["gpus"]), int(row["global_batch"]), layout,
                                 float(row["tflops_per_gpu"])))
    precision = "fp16" if "fp16" in setup.get("precision", "fp16") else "bf16"
    return PublishedTable("Megatron-LM SC'21 Table 1", data["source"], data.get("cluster", "a100-80gb"),
                          ENGINES[data.get("engine", "megatron-2021")], precision,
                          data.get("metric", "hardware_tflops_per_gpu"), bool(data.get("fitted", True)), runs)


def load_table(path: str | Path) -> PublishedTable:
    """The published runs of one file; a malformed file is a ValueError naming it and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    try:
        return _columns_table(data) if "columns" in data else _rows_table(data, path)
    except KeyError as e:
        raise ValueError(f"{path}: no {e} (the keys a published file holds: compiler/README.md, "
                         f"'Published runs')") from None


def _rows_table(data: dict, path: str | Path) -> PublishedTable:
    if data["engine"] not in ENGINES:
        raise ValueError(f"{path}: engine {data['engine']!r}: one of {', '.join(ENGINES)}")
    models = data.get("models", {})
    runs = []
    for row in data["rows"]:
        dispatcher = row.get("dispatcher", "all-to-all")
        if dispatcher not in EP_DISPATCHES:
            raise ValueError(f"{path}: row {row['label']!r}: dispatcher {dispatcher!r}: one of "
                             f"{', '.join(EP_DISPATCHES)}")
        shape = _shape(models.get(row["model"], row["model"]), int(row["seq_len"]))
        layout = {k: row["layout"][key] for key, k in LAYOUT_KEYS.items() if key in row["layout"]}
        if isinstance(layout.get("schedule"), list):
            layout["schedule"] = tuple(layout["schedule"])
        runs.append(PublishedRun(row["label"], shape, int(row["gpus"]), int(row["global_batch"]),
                                 Constraints(**layout), float(row["reported"]), row.get("memory_gib"),
                                 bool(row.get("float8", False)), dispatcher,
                                 tuple(row.get("unmodelled", ())), row.get("note", "")))
    source = data["source"]
    source = source if isinstance(source, str) else f"{source['citation']} ({source.get('url', '')})"
    return PublishedTable(data["name"], source, data["cluster"], ENGINES[data["engine"]], data["precision"],
                          data["metric"], bool(data["fitted"]), runs)


def published_files() -> list[Path]:
    return sorted(PUBLISHED_DIR.glob("*.json"))


@dataclass(frozen=True)
class RowResult:
    table: PublishedTable
    run: PublishedRun
    priced: Estimate | None  # the best plan within the stated layout (fitting, else the fastest)

    @property
    def predicted(self) -> float | None:
        return None if self.priced is None else metric_value(self.table.metric, self.priced, self.run)

    @property
    def error(self) -> float | None:
        """Predicted over published, minus one (for step times: published over predicted, so that + is optimistic)."""
        if self.predicted is None:
            return None
        if self.table.metric == "step_time_s":
            return self.run.reported / self.predicted - 1
        return self.predicted / self.run.reported - 1

    @property
    def memory_error(self) -> float | None:
        if self.priced is None or self.run.memory_gib is None:
            return None
        return self.priced.memory_per_rank / 2**30 / self.run.memory_gib - 1


def metric_value(metric: str, e: Estimate, run: PublishedRun) -> float:
    tokens = e.tokens_per_sec
    if metric == "tokens_per_s_per_gpu":
        return tokens / run.gpus
    if metric == "step_time_s":
        return e.step_time
    if metric == "model_tflops_per_gpu":
        return e.model_tflops_per_gpu
    if metric == "hardware_tflops_per_gpu":
        full = e.candidate.ac == "full"
        return hardware_flops_per_token(run.shape, activation_checkpointing=full) * tokens / run.gpus / 1e12
    raise ValueError(f"unknown metric {metric}")


def price_run(table: PublishedTable, run: PublishedRun, cluster: Cluster) -> Estimate | None:
    traits = replace(table.engine, float8_linears=run.float8, ep_dispatch=run.dispatcher)
    args = dict(world=run.gpus, global_batch_size=run.global_batch, cluster=cluster, traits=traits,
                precisions=(table.precision,), constraints=traits.limits(run.layout))
    return search(run.shape, **args).best or search(run.shape, require_fit=False, **args).best


def reproduce(table: PublishedTable, cluster: Cluster | None = None) -> list[RowResult]:
    cluster = cluster or load_cluster(table.cluster)
    return [RowResult(table, run, price_run(table, run, cluster)) for run in table.runs]


def summary(results: list[RowResult]) -> dict:
    """Median and largest |error|, and how many rows are within 25%, over the rows priced."""
    errors = [abs(r.error) for r in results if r.error is not None]
    return {"rows": len(results), "priced": len(errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "within_25_percent": sum(e <= 0.25 for e in errors)}


def fit_max_efficiency(table: PublishedTable, cluster: Cluster, *, k_half: float | None = None) -> float:
    """The GEMM curve's ``max_efficiency`` whose predictions have zero mean log error over the table's rows
    (bisection: the predictions rise with it)."""
    k = cluster.device.gemm.k_half if k_half is None else k_half
    lo, hi = 0.2, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        trial = replace(cluster, device=replace(cluster.device, gemm=GemmEfficiency(mid, k)))
        logs = [math.log(1 + r.error) for r in reproduce(table, trial) if r.error is not None]
        if statistics.mean(logs) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
