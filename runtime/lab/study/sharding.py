"""Two study sections on data parallelism.

``sharding``: memory per configuration (the DeepSpeed/TP seed's table). GPT-2 small (sequence 128 in the
full study) trained for a few steps on 8 ranks under each DP mode and mesh, bf16 by default, plus
activation checkpointing and the other precisions on 2x2x2, and 2x2x2 at several micro-batch sizes for
MFU. Each row: the measured peak tensor memory (``--profile-memory``, the maximum over ranks), the
planner's prediction for the same plan, the peak resident memory, the largest parameter count one rank
holds, and the reduction against plain replication (every rank holding the whole model, ``--dp-shard 1``
on all ranks, measured in the same section). The full study adds GPT-2 Large at 2x2x2 once.

``replicate``: ``--dp 2 --dp-shard 1`` against a plain ``DistributedDataParallel`` loop with ``no_sync``
accumulation on 2 ranks, and FSDP (``--dp 2``) beside them, alternated ``rounds`` times.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from compiler.parallel_plan import AC, ParallelPlan
from compiler.planner.cluster import load_cluster
from compiler.planner.search import Pricer
from compiler.planner.shape import DecoderShape
from models import named_config
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import default_config, model_flags
from runtime.commands.launch import RunSpec
from runtime.config import plan_error
from runtime.lab.plain_loop import plain_flags
from runtime.lab.study.analysis import pooled_samples_per_sec
from runtime.observe.svg import bar_chart


@dataclass(frozen=True)
class MemoryRow:
    label: str  # the configuration's name in the table
    plan: ParallelPlan

    def meta(self) -> dict:
        """What a run record carries of the row, read back by ``memory_table``, the report and the HParams tab."""
        p = self.plan
        return {"label": self.label, "dp": p.dp, "pp": p.pp, "mp": p.mp, "dp_shard": p.dp_shard,
                "zero3": p.reshard_after_forward, "precision": p.precision, "activation_checkpointing": p.ac != AC.NONE,
                "micro_batch_size": p.micro_batch_size, "sequence_parallel": p.sequence_parallel,
                "microbatches": p.microbatches}


def memory_row(label: str, dp: int, pp: int, mp: int, *, dp_shard: int | None = None, zero3: bool = False,
               precision: str = "bf16", activation_checkpointing: bool = False, micro_batch_size: int = 2,
               sequence_parallel: bool = False, microbatches: int | None = None) -> MemoryRow:
    """A row's plan: pipelines run interleaved 1F1B (v=2), the rest 1F1B; ``microbatches`` None: 2 per pp rank."""
    schedule, v = ("interleaved-1f1b", 2) if pp > 1 else ("1f1b", 1)
    return MemoryRow(label, ParallelPlan(
        dp=dp, pp=pp, mp=mp, schedule=schedule, stages_per_rank=v, microbatches=microbatches or 2 * pp,
        micro_batch_size=micro_batch_size, precision=precision, ac="full" if activation_checkpointing else "none",
        dp_shard=dp_shard, reshard_after_forward=zero3, sequence_parallel=sequence_parallel))


def row_of_run(record: dict) -> MemoryRow:
    """The row a run record describes; a field the record lacks (written before it existed) takes its default."""
    fields = inspect.signature(memory_row).parameters
    return memory_row(**{k: record[k] for k in fields if k in record})


REPLICATION = "replicate (DDP layout)"
ROWS_8 = (
    # A replica's memory does not depend on how many there are; eight replicas of GPT-2 small (each ~2.5 GiB
    # with AdamW and its gradient buckets) do not fit this machine's 24 GiB, so the baseline runs on 2 ranks.
    memory_row(REPLICATION, 2, 1, 1, dp_shard=1),
    memory_row("FSDP", 8, 1, 1),
    memory_row("HSDP (shard 4, replicate 2)", 8, 1, 1, dp_shard=4),
    memory_row("ZeRO-3", 8, 1, 1, zero3=True),
    memory_row("TP", 1, 1, 2),
    memory_row("TP", 1, 1, 4),
    memory_row("TP + SP", 1, 1, 4, sequence_parallel=True),
    memory_row("DP x TP", 4, 1, 2),
    memory_row("DP x PP", 4, 2, 1),
    memory_row("2x2x2", 2, 2, 2),
    memory_row("2x2x2 + AC", 2, 2, 2, activation_checkpointing=True),
    memory_row("2x2x2", 2, 2, 2, precision="fp32"),
    memory_row("2x2x2", 2, 2, 2, micro_batch_size=1),
    # fp16 at micro-batch 1 only: this CPU has no fp16 arithmetic (~0.9 GFLOP/s), so at micro-batch 2 GPT-2
    # small's fp16 steps outlast the study's timeout; its memory compares with the bf16 row above.
    memory_row("2x2x2", 2, 2, 2, precision="fp16", micro_batch_size=1),
    memory_row("2x2x2", 2, 2, 2, micro_batch_size=4),
)
# The smoke study's: the same kinds of row on 4 ranks.
ROWS_4 = (
    memory_row(REPLICATION, 4, 1, 1, dp_shard=1),
    memory_row("FSDP", 4, 1, 1),
    memory_row("HSDP (shard 2, replicate 2)", 4, 1, 1, dp_shard=2),
    memory_row("ZeRO-3", 4, 1, 1, zero3=True),
    memory_row("DP x TP x PP", 1, 2, 2),
)
# The smoke study's: the baseline and one sharded row, on 2 ranks.
ROWS_SMOKE = (memory_row(REPLICATION, 2, 1, 1, dp_shard=1), memory_row("ZeRO-3", 2, 1, 1, zero3=True))
LARGE_MODEL = named_config("large", seq_len=256)
LARGE = memory_row("GPT-2 Large 2x2x2, ZeRO-3 + AC", 2, 2, 2, zero3=True, activation_checkpointing=True,
                   micro_batch_size=1)
# A Llama 3 shape of GPT-2 small's width and depth (GQA with 4 kv heads, SwiGLU by Meta's rule, RMSNorm, RoPE).
LLAMA_MODEL = named_config("llama3-debug", n_layers=12, d_model=768, n_heads=12, n_kv_heads=4, seq_len=128,
                           vocab_size=32000)
LLAMA_ROWS = (memory_row("Llama 3 shape 2x2x2", 2, 2, 2),
              memory_row("Llama 3 shape 2x2x2 + SP", 2, 2, 2, sequence_parallel=True))
# Sequence parallelism where activations set the step's peak: GPT-2 small at T 1024, one micro-batch of 4, fp32.
# At T 128 (the rows above) the peak is set by a phase SP does not touch and the two rows differ by noise; at
# T 1024 with two micro-batches of 2 as well, while the model alone (forward, loss, backward, AdamW) saved memory
# there.
LONG_MODEL = named_config("small", seq_len=1024)
LONG_ROWS = tuple(memory_row("TP + SP" if sp else "TP", 1, 1, 4, precision="fp32", micro_batch_size=4, microbatches=1,
                             sequence_parallel=sp) for sp in (False, True))
# Rows of other models than the section's: run meta "model" -> (config, name in the table).
OTHER_MODELS = {"large": (LARGE_MODEL, "GPT-2 Large"), "llama": (LLAMA_MODEL, "Llama 3 shape, 12 x d 768, kv 4"),
                "long": (LONG_MODEL, "GPT-2 small")}


def memory_rows(world: int, *, smoke: bool = False) -> tuple[MemoryRow, ...]:
    if smoke:
        return ROWS_SMOKE if world >= 2 else ()
    return ROWS_8 if world >= 8 else ROWS_4 if world >= 4 else ()


def _common(steps: int, *, profile_memory: bool = True) -> list[str]:
    return ["--data", "synthetic", "--steps", str(steps), "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
            "--seed", "1234", *(["--profile-memory"] if profile_memory else [])]


MEMORY_METHOD = (
    "Each row is a real training run of a few steps with `--profile-memory`: peak tensor memory is the maximum over "
    "ranks of the bytes live at the start of step 2 plus the step's peak growth (the CPU counterpart of "
    "max_memory_allocated); resident is the largest peak RSS of a rank (interpreter, libraries and allocator slack "
    "included). 'predicted' is the planner's memory model for the same plan (compiler/planner/memory_model.py). "
    "'params on one rank' is the most parameter elements any rank holds over the model's (a tied weight once). "
    "'reduction vs replication' divides the replicate row's peak by the row's (a replica holds the same whatever "
    "the number of replicas, so the baseline may run on fewer ranks). Pipelines use interleaved 1F1B, "
    "v=2, 2 micro-batches per pp rank; the rest 1F1B with 2 micro-batches.")


def memory_specs(world: int, model, *, large: bool, other_shapes: bool = False, smoke: bool = False) -> list[RunSpec]:
    """The section's runs on up to ``world`` ranks; ``large``: GPT-2 Large at 2x2x2; ``other_shapes``: the Llama 3
    shape at 2x2x2 and GPT-2 small at T 1024 on 1x1x4, each with and without SP (runs of 100M+ parameters, a
    minute or more each here)."""
    specs = []
    for row in memory_rows(world, smoke=smoke):
        name = f"sharding_{row.plan.describe()}".replace(" ", "_").replace("=", "")
        specs.append(_spec(name, row, [*model_flags(model), *plan_flags(row.plan), *_common(3)]))
    if large and world >= 8:
        # GPT-2 Large's Adam state and copies fill most of 24 GiB: large tensors are returned to the kernel.
        # No --profile-memory: its event buffers would add to a peak that is already near the machine's memory.
        args = [*model_flags(LARGE_MODEL), *plan_flags(LARGE.plan), "--compact-cpu-memory",
                *_common(3, profile_memory=False)]
        specs.append(_spec("sharding_gpt2_large", LARGE, args, model="large"))
    if other_shapes and world >= 8 and not smoke:
        for key, rows in (("llama", LLAMA_ROWS), ("long", LONG_ROWS)):
            shape = OTHER_MODELS[key][0]
            for row in rows:
                name = f"sharding_{key}_{row.plan.describe()}".replace(" ", "_").replace("=", "")
                specs.append(_spec(name, row, [*model_flags(shape), *plan_flags(row.plan), *_common(3)], model=key))
    return specs


def _spec(name: str, row: MemoryRow, args: list[str], *, model: str | None = None) -> RunSpec:
    """A row's run; ``model``: the key of another model than the section's (OTHER_MODELS)."""
    meta = {"section": "sharding", **row.meta(), **({"model": model} if model else {})}
    return RunSpec(name, row.plan.world, args, meta=meta)


def predicted_bytes(row: MemoryRow, model) -> float | None:
    if plan_error(default_config(model), row.plan):
        return None
    return max(Pricer(DecoderShape.from_config(model), load_cluster("cpu-2core")).rank_memories(row.plan))


def memory_table(runs: list[dict], model) -> list[dict]:
    """One row per run with the measured peak, the prediction and the reduction against replication."""
    baseline = next((r["summary"]["peak_tensor_bytes"] for r in runs
                     if r["ok"] and r["label"] == REPLICATION and r.get("model") is None), None)
    table = []
    for r in runs:
        row = row_of_run(r)
        shape, name = OTHER_MODELS.get(r.get("model"), (model, f"{model.n_layers} x d {model.d_model}"))
        out = {**row.meta(), "model": f"{name}, T {shape.seq_len}", "ok": r["ok"], "error": r.get("error"),
               "predicted_bytes": predicted_bytes(row, shape)}
        if r["ok"]:
            s = r["summary"]
            out |= {"peak_tensor_bytes": s.get("peak_tensor_bytes"), "peak_resident_bytes": max(s["peak_bytes_per_rank"]),
                    "local_parameters_max": s.get("local_parameters_max"), "parameters": s.get("parameters"),
                    "mfu": s.get("mfu"), "tokens_per_sec": s.get("tokens_per_sec"),
                    "reduction_vs_replication": baseline / s["peak_tensor_bytes"]
                    if baseline and s.get("peak_tensor_bytes") and r.get("model") is None else None}
        table.append(out)
    return table


def replicate_summary(runs: list[dict]) -> dict:
    """Samples/s of each contender pooled over its repetitions, and replicate's ratio to DDP per round."""
    def pooled(who: str) -> float | None:
        return pooled_samples_per_sec([r for r in runs if r["who"] == who and r["ok"]])

    by_round = []
    for r in sorted({r["round"] for r in runs}):
        pair = {x["who"]: x for x in runs if x["round"] == r and x["ok"]}
        if "replicate" in pair and "ddp" in pair:
            by_round.append(pair["replicate"]["summary"]["samples_per_sec"] / pair["ddp"]["summary"]["samples_per_sec"])
    rep, ddp, fsdp = pooled("replicate"), pooled("ddp"), pooled("fsdp")
    return {"replicate_samples_per_sec": rep, "ddp_samples_per_sec": ddp, "fsdp_samples_per_sec": fsdp,
            "replicate_over_ddp": rep / ddp if rep and ddp else None, "replicate_over_ddp_by_round": by_round,
            "fsdp_over_ddp": fsdp / ddp if fsdp and ddp else None, "repetitions": len(by_round)}


def replicate_specs(rounds: int, model, *, micro_batch_size: int, microbatches: int, steps: int) -> list[RunSpec]:
    """The replicate benchmark's alternated runs of ``model`` (a family config the plain loop builds too): engine
    replicate, plain DDP, engine FSDP."""
    batching = ["--micro-batch-size", str(micro_batch_size), "--microbatches", str(microbatches)]
    engine = ["--dp", "2", *model_flags(model), *batching, "--data", "synthetic", "--precision", "fp32",
              "--steps", str(steps), "--log-every", str(steps), "--eval-every", "0", "--eval-batches", "1",
              "--seed", "1234", "--peak-tflops", "1"]
    plain = [*plain_flags(model), *batching, "--steps", str(steps), "--precision", "fp32"]
    specs = []
    for r in range(rounds):
        trio = [RunSpec(f"replicate_engine_r{r}", 2, [*engine, "--dp-shard", "1"],
                        meta={"section": "replicate", "who": "replicate", "round": r}),
                RunSpec(f"replicate_ddp_r{r}", 2, plain, kind="plain", meta={"section": "replicate", "who": "ddp", "round": r}),
                RunSpec(f"replicate_fsdp_r{r}", 2, engine, meta={"section": "replicate", "who": "fsdp", "round": r})]
        specs += trio if r % 2 == 0 else trio[::-1]
    return specs


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3f}"


def row_label(r: dict) -> str:
    extras = [r["precision"], f"mbs {r['micro_batch_size']}"] + (["+AC"] if r["activation_checkpointing"] else [])
    return f"{r['label']} ({r['dp']}x{r['pp']}x{r['mp']}, {', '.join(extras)})"


def memory_chart(results: dict, title: str) -> str | None:
    rows = [r for r in (results.get("sharding") or {}).get("table", []) if r.get("peak_tensor_bytes")]
    if not rows:
        return None
    return bar_chart(title, [row_label(r) for r in rows],
                     {"measured peak tensor memory": [r["peak_tensor_bytes"] / 2**30 for r in rows],
                      "planner's prediction": [(r["predicted_bytes"] or 0) / 2**30 or None for r in rows]},
                     value_label="GiB per rank (the busiest rank)")


def memory_markdown(section: dict) -> list[str]:
    lines = ["## Memory per configuration", "", section["method"], "",
             "| configuration | model | peak tensor GiB (measured) | predicted GiB | error | peak resident GiB | "
             "params on one rank / model | reduction vs replication | MFU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in section["table"]:
        head = f"| {row_label(r)} | {r['model']} |"
        if not r["ok"]:
            lines.append(head + f" failed: {r['error']} |" + " |" * 7)
            continue
        measured = r["peak_tensor_bytes"]
        error = (r["predicted_bytes"] - measured) / measured if r["predicted_bytes"] and measured else None
        share = (r["local_parameters_max"] / r["parameters"]) if r.get("parameters") else None
        reduction = f"{r['reduction_vs_replication']:.2f}x" if r.get("reduction_vs_replication") else "-"
        mfu = r.get("mfu")
        lines.append(head + f" {_gib(r['peak_tensor_bytes'])} | {_gib(r['predicted_bytes'])} | "
                     f"{'n/a' if error is None else f'{100 * error:+.0f}%'} | {_gib(r['peak_resident_bytes'])} | "
                     f"{'n/a' if share is None else f'{100 * share:.1f}%'} | {reduction} | "
                     f"{'n/a' if mfu is None else f'{100 * mfu:.2f}%'} |")
    return lines + [""]


def replicate_markdown(section: dict) -> list[str]:
    s = section["summary"]

    def rate(x):
        return "n/a" if x is None else f"{x:.2f}"

    by_round = ", ".join(f"{x:.2f}x" for x in s["replicate_over_ddp_by_round"])
    return ["## Replicate against DistributedDataParallel", "", section["method"], "",
            "| contender | samples/s (pooled) | vs DDP |", "| --- | --- | --- |",
            f"| engine `--dp 2 --dp-shard 1` (replicate) | {rate(s['replicate_samples_per_sec'])} | "
            f"{rate(s['replicate_over_ddp'])}x (repetitions: {by_round or 'n/a'}) |",
            f"| plain DDP loop, `no_sync` accumulation | {rate(s['ddp_samples_per_sec'])} | 1.00x |",
            f"| engine `--dp 2` (FSDP) | {rate(s['fsdp_samples_per_sec'])} | {rate(s['fsdp_over_ddp'])}x |", ""]
