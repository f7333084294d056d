"""Published runs as files (compiler/published/*.json): the format, read and checked.

A file names its source, the cluster preset it ran on, the engine that ran it (compiler/planner/engines.py),
the metric it reports and, per row, the model, GPUs, sequence, global batch, the layout the source states
(dp, pp, mp, cp, ep, micro-batch, schedule, v, checkpointing, DP mode, SP; the experts' ETP and EDP where
stated, checked, not searched) and the reported figure (and
peak memory where given; a MoE row's ``dispatcher``; Megatron's ``recompute_modules`` where the source
names them). ``fitted`` marks the files a constant was fitted to
(in-sample). Features a row used that the model does not describe are listed in its ``unmodelled``.

Every key a price depends on is checked on reading: a key the planner does not know (``"tp"`` for ``"mp"``,
an attention kind it has no formula for), a schedule, checkpointing or DP mode it does not have, or a
layout that does not fill the row's GPUs is a ValueError naming the file, the row and what is valid, never
a key silently ignored or a row silently left unpriced. Files are compiler/README.md's "Published runs".
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from compiler.parallel_plan import AC_MODES, is_dp_mode
from compiler.planner.candidates import Constraints, mesh_misfit
from compiler.planner.cluster import preset_names
from compiler.planner.engines import ENGINES, EP_DISPATCHES, EngineTraits
from compiler.planner.shape import DecoderShape
from compiler.planner.step import expert_data_parallel
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES
from models import MODEL_NAMES, named_config
from models.spec import Experts

PUBLISHED_DIR = Path(__file__).resolve().parent.parent / "published"
METRICS = ("hardware_tflops_per_gpu", "model_tflops_per_gpu", "megatron_tflops_per_gpu", "tokens_per_s_per_gpu",
           "step_time_s")
LAYOUT_KEYS = ("dp", "pp", "mp", "cp", "ep", "micro_batch_size", "schedule", "stages_per_rank", "ac", "dp_mode",
               "sequence_parallel")
# What a source may also state of its experts' layout, checked against what the planner prices rather than
# searched: Megatron-Core's ETP (--expert-tensor-parallel-size; the planner keeps experts whole, ETP 1) and
# EDP (the ranks holding the same experts, step.py ``expert_data_parallel``).
EXPERT_LAYOUT_KEYS = ("expert_tp", "expert_dp")
SIZE_KEYS = ("dp", "pp", "mp", "cp", "ep", "micro_batch_size", "stages_per_rank")
ROW_KEYS = ("label", "model", "gpus", "seq_len", "global_batch", "layout", "reported", "memory_gib", "float8",
            "dispatcher", "recompute_modules", "unmodelled", "note")
# Megatron-Core's --recompute-modules under --recompute-granularity selective, as the planner prices them
# (engines.py ``selective_policy``): the sets it prices exactly, norms and activation functions recomputed
# ("products"), or also the whole MoE MLP ("products+moe"). Another set (norm outputs kept, attention's core
# or a dense MLP recomputed) would be priced as one of these, so it is an error, not a silent approximation.
RECOMPUTE_MODULES = ("layernorm", "moe_act", "moe")
RECOMPUTE_POLICIES = {frozenset({"layernorm", "moe_act"}): "products", frozenset({"layernorm", "moe"}): "products+moe",
                      frozenset({"layernorm", "moe_act", "moe"}): "products+moe"}
# A model given by its sizes: ``run.py plan``'s shape flags (DecoderShape.from_flags) plus ``positions``, and
# ``experts`` as an object of models.spec.Experts' fields.
MODEL_KEYS = tuple(k for k in inspect.signature(DecoderShape.from_flags).parameters if k != "seq_len") + ("positions",)
EXPERT_KEYS = tuple(f.name for f in fields(Experts))
POSITIONS = ("learned", "rope", "alibi", "none")


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
    selective_policy: str | None = None  # from the row's ``recompute_modules``; None: the engine's
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


def _unknown(what: str, given, valid) -> str | None:
    extra = [k for k in given if k not in valid]
    return f"{what} {extra[0]!r}: one of {', '.join(valid)}" if extra else None


def _shape(spec: dict | str, seq_len: int) -> DecoderShape:
    """A model of the registry by name, or explicit sizes (``run.py plan``'s shape flags as JSON keys)."""
    if isinstance(spec, str):
        if spec not in MODEL_NAMES:
            raise ValueError(f"model {spec!r}: neither in the file's \"models\" nor a named model "
                             f"({', '.join(MODEL_NAMES)})")
        return DecoderShape.from_config(named_config(spec, seq_len=seq_len))
    d = dict(spec)
    error = _unknown("model key", d, MODEL_KEYS) or _unknown("experts key", d.get("experts", {}), EXPERT_KEYS)
    if error:
        raise ValueError(error)
    missing = [k for k in ("layers", "d_model", "heads", "vocab_size") if k not in d]
    if missing:
        raise ValueError(f"model: no {missing[0]!r}")
    experts = None
    if "experts" in d:
        e = dict(d.pop("experts"))
        experts = Experts(**{**e, "dense_layers": tuple(e.get("dense_layers", ()))})
    positions = d.pop("positions", None)
    if positions not in (None, *POSITIONS):  # only a learned table has parameters (shape.py)
        raise ValueError(f"model positions {positions!r}: one of {', '.join(POSITIONS)}")
    shape = DecoderShape.from_flags(seq_len=seq_len, experts=experts, **d)
    return replace(shape, positions=positions) if positions else shape


def _layout_error(layout: dict, gpus: int, global_batch: int) -> str | None:
    """What is wrong with a row's stated layout, or None."""
    error = _unknown("layout key", layout, LAYOUT_KEYS + EXPERT_LAYOUT_KEYS)
    if error:
        return error
    for key in SIZE_KEYS + EXPERT_LAYOUT_KEYS:
        if key in layout and not (isinstance(layout[key], int) and layout[key] >= 1):
            return f"layout {key} {layout[key]!r}: a positive integer"
    schedules = layout.get("schedule")
    for name in [schedules] if isinstance(schedules, str) else schedules or []:
        if name not in SCHEDULES:
            return f"layout schedule {name!r}: one of {', '.join(SCHEDULES)}"
    if layout.get("ac", "none") not in AC_MODES:
        return f"layout ac {layout['ac']!r}: one of {', '.join(AC_MODES)}"
    if "dp_mode" in layout and not is_dp_mode(layout["dp_mode"]):
        return f"layout dp_mode {layout['dp_mode']!r}: one of none, fsdp, zero3, replicate, hsdp:N"
    if not isinstance(layout.get("sequence_parallel", False), bool):
        return f"layout sequence_parallel {layout['sequence_parallel']!r}: true or false"
    mesh = {k: layout[k] for k in ("dp", "pp", "mp", "cp") if k in layout}
    product = mesh_misfit(mesh, gpus)  # a dimension left out is searched (e.g. cp = gpus / dp pp mp)
    if product:
        stated = " x ".join(f"{k} {n}" for k, n in mesh.items())
        return f"layout {stated} is {product} GPUs, the row has {gpus}"
    if "dp" in layout and global_batch % layout["dp"]:
        return f"global_batch {global_batch} is not a multiple of dp {layout['dp']}"
    return None


def _expert_layout_error(layout: dict) -> str | None:
    """A stated ETP the planner does not price, or a stated EDP other than the one its layout gives."""
    if layout.get("expert_tp", 1) != 1:
        return (f"layout expert_tp {layout['expert_tp']}: the planner prices experts whole on each EP rank "
                f"(expert tensor parallelism 1) only")
    if "expert_dp" not in layout:
        return None
    missing = [k for k in ("dp", "mp", "cp", "ep") if k not in layout]
    if missing:
        return f"layout expert_dp: checked against dp, mp, cp and ep, so those are stated too ({missing[0]} is not)"
    edp = expert_data_parallel(dp=layout["dp"], cp=layout["cp"], mp=layout["mp"], ep=layout["ep"])
    if layout["expert_dp"] != edp:
        return (f"layout expert_dp {layout['expert_dp']}: dp {layout['dp']} x cp {layout['cp']} x mp {layout['mp']} "
                f"/ ep {layout['ep']} is {edp} (with expert_tp 1)")
    return None


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
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        table = _columns_table(data) if "columns" in data else _rows_table(data)
    except KeyError as e:
        raise ValueError(f"{path}: no {e} (the keys a published file holds: compiler/README.md, "
                         f"'Published runs')") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if table.cluster not in preset_names() and not Path(table.cluster).exists():
        raise ValueError(f"{path}: cluster {table.cluster!r}: a preset ({', '.join(preset_names())}) or a "
                         f"cluster file")
    return table


def _row(row: dict, models: dict) -> PublishedRun:
    error = _unknown("key", row, ROW_KEYS)
    dispatcher = row.get("dispatcher", "all-to-all")
    if dispatcher not in EP_DISPATCHES:
        error = error or f"dispatcher {dispatcher!r}: one of {', '.join(EP_DISPATCHES)}"
    gpus, batch = int(row["gpus"]), int(row["global_batch"])
    error = error or _layout_error(row["layout"], gpus, batch)
    modules = row.get("recompute_modules")
    policy = None
    if modules is not None and not error:
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES] if isinstance(modules, list) else [modules]
        if unknown:
            error = f"recompute_modules {unknown[0]!r}: a list of {', '.join(RECOMPUTE_MODULES)}"
        elif frozenset(modules) not in RECOMPUTE_POLICIES:
            priced = " or ".join(str(sorted(m)) for m in RECOMPUTE_POLICIES)
            error = f"recompute_modules {modules}: priced are {priced} (what else a set keeps or recomputes is not modelled)"
        elif row["layout"].get("ac") != "selective":
            error = "recompute_modules: only with layout ac \"selective\" (Megatron's --recompute-granularity selective)"
        else:
            policy = RECOMPUTE_POLICIES[frozenset(modules)]
    if error:
        raise ValueError(error)
    shape = _shape(models.get(row["model"], row["model"]), int(row["seq_len"]))
    layout = {k: row["layout"][k] for k in LAYOUT_KEYS if k in row["layout"]}
    if isinstance(layout.get("schedule"), list):
        layout["schedule"] = tuple(layout["schedule"])
    ep = layout.get("ep", 1)
    if ep > 1 and (shape.experts is None or shape.experts.count % ep):
        raise ValueError(f"layout ep {ep}: ep divides the model's experts "
                         f"({shape.experts.count if shape.experts else 'it has none'})")
    error = _expert_layout_error(row["layout"])
    if error:
        raise ValueError(error)
    return PublishedRun(row["label"], shape, gpus, batch, Constraints(**layout), float(row["reported"]),
                        row.get("memory_gib"), bool(row.get("float8", False)), dispatcher, policy,
                        tuple(row.get("unmodelled", ())), row.get("note", ""))


def _rows_table(data: dict) -> PublishedTable:
    if data["engine"] not in ENGINES:
        raise ValueError(f"engine {data['engine']!r}: one of {', '.join(ENGINES)}")
    if data["metric"] not in METRICS:
        raise ValueError(f"metric {data['metric']!r}: one of {', '.join(METRICS)}")
    if data["precision"] not in PRECISIONS:
        raise ValueError(f"precision {data['precision']!r}: one of {', '.join(PRECISIONS)}")
    models = data.get("models", {})
    runs = []
    for i, row in enumerate(data["rows"]):
        try:
            runs.append(_row(row, models))
        except KeyError as e:
            raise ValueError(f"row {row.get('label', i)!r}: no {e}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"row {row.get('label', i)!r}: {e}") from None
    source = data["source"]
    source = source if isinstance(source, str) else f"{source['citation']} ({source.get('url', '')})"
    return PublishedTable(data["name"], source, data["cluster"], ENGINES[data["engine"]], data["precision"],
                          data["metric"], bool(data["fitted"]), runs)


def published_files() -> list[Path]:
    return sorted(PUBLISHED_DIR.glob("*.json"))
