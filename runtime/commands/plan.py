"""``python run.py plan``: rank every (dp, pp, mp, schedule, v, micro-batching, precision, AC) plan
for a world size on a cluster, and ``--auto`` training with the best one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections import Counter

from compiler.planner.candidates import Constraints, dp_mode
from compiler.planner.cluster import CALIBRATED, LOCAL_PRESET, Cluster, preset_names, resolve_cluster
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.gpu_search import GpuEstimate, search
from compiler.planner.search import Estimate
from compiler.planner.shape import DecoderShape, hardware_flops_per_token, model_flops_per_token
from compiler.precisions import PRECISIONS
from models import MODEL_NAMES, named_config
from runtime.commands import plan_gpu, plan_reproduce
from runtime.commands.flags import (
    AUTO_CHOSEN,
    HelpFormatter,
    build_config,
    default_config,
    explicit_flags,
    named_model,
    with_default_logdir,
)
from runtime.commands.plan_validation import validate
from runtime.commands.precision_probe import check_calibration
from runtime.commands.speed_probe import probe
from runtime.config import ConfigError, TrainConfig, apply_plan, plan_error
from runtime.config import validate as validate_config
from runtime.device import has_accelerator
from runtime.planning import best_plan, rank_plans

DEFAULT_GLOBAL_BATCH = 32


def format_table(estimates: list[Estimate], top: int) -> str:
    feasible = [e for e in estimates if e.feasible]
    lines = [f"{'#':>3}  {'plan (dp x pp x mp, schedule, v, m, mbs, precision)':<58} {'step (s)':>9} {'tokens/s':>10} "
             f"{'MFU':>7} {'GiB/rank':>9}"]
    for i, e in enumerate(feasible[:top], 1):
        lines.append(f"{i:>3}  {e.candidate.describe():<58} {e.step_time:>9.3f} {e.tokens_per_sec:>10,.0f} "
                     f"{100 * e.mfu:>6.2f}% {e.memory_per_rank / 2**30:>9.3f}")
    reasons = Counter(re.sub(r"\d+", "N", e.reason.split(";")[0]) for e in estimates if not e.feasible)
    lines.append(f"{len(feasible)} feasible plans of {len(estimates)}; infeasible: "
                 + (", ".join(f"{n} x {r}" for r, n in reasons.most_common()) or "none"))
    return "\n".join(lines)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py plan", formatter_class=HelpFormatter,
        description="Rank every (dp, pp, mp, schedule, v, micro-batching, precision, activation checkpointing) "
                    "plan for a world size by predicted step time on a cluster: this CPU machine (its calibration) "
                    "or a GPU cluster (a preset or a cluster file: any decoder shape, up to tens of thousands of "
                    "GPUs, priced in closed form). Infeasible plans are counted with the reason.")
    p.add_argument("--world", type=int, help="number of ranks (GPUs); required unless --reproduce")
    p.add_argument("--model", choices=tuple(MODEL_NAMES), default="small",
                   help="named model (see run.py --help); the shape flags below override it")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH, help="sequences per optimizer step")
    p.add_argument("--cluster", help=f"cluster JSON or preset ({', '.join(preset_names())}); default: on a CUDA "
                                     f"machine its GPU's preset, else the file `run.py calibrate` wrote ({CALIBRATED}) "
                                     f"if any, else {LOCAL_PRESET}")
    p.add_argument("--speed-probe", action="store_true",
                   help="planning for this machine, first re-run two of calibration's recorded engine runs "
                        "(~30 s) and rescale the calibration by their speed now (runtime/commands/speed_probe.py)")
    p.add_argument("--precisions", help="comma-separated precisions to consider (default: fp32,bf16,fp16 on CPU, "
                                        "bf16 on GPU clusters)")
    p.add_argument("--top", type=int, help="rows of the ranked table (default 15 on CPU, 5 on GPU clusters)")
    p.add_argument("--out", default="plan.json", help="CPU: where to write every plan with its estimate")
    p.add_argument("--validate", action="store_true",
                   help="run every feasible mesh of the tiny and small models on this machine and compare "
                        "predicted with measured step times")
    p.add_argument("--reproduce", metavar="FILE", help="price a published table of runs (e.g. "
                   "compiler/published/megatron_sc21_table1.json) at its layouts and beside the planner's best")
    p.add_argument("--fit", action="store_true", help="with --reproduce: refit the GEMM efficiency constant to it")
    plan_gpu.add_flags(p)
    return p


def main(argv: list[str]) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.reproduce:
            return plan_reproduce.main(args)
        if args.world is None or args.world < 1 or args.global_batch_size < 1:
            raise ConfigError("--world and --global-batch-size must be positive (--world is required)")
        for flag in plan_gpu.SHAPE_FLAGS:
            value = getattr(args, flag)
            if isinstance(value, int) and value < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
        cluster = resolve_cluster(args.cluster)
        if isinstance(cluster, GpuCluster):
            return plan_gpu.main(args, cluster)
        return cpu_main(args, cluster)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def cpu_model(args: argparse.Namespace):
    """The engine's model of --model with the shape flags' overrides (the CPU planner counts the model it builds)."""
    base = named_model(args.model)
    kind = "swiglu" if base.family == "llama3" else "gelu"
    if args.mlp and args.mlp != kind:
        raise ConfigError(f"--mlp {args.mlp}: --model {args.model} has a {kind} MLP; on this machine's planner pick a "
                          f"--model of the family you mean (gelu: GPT-2 sizes, swiglu: llama3-*), or plan for a GPU "
                          f"cluster (--cluster {' or '.join(n for n in preset_names() if n != LOCAL_PRESET)})")
    try:
        return named_config(args.model, n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                            n_kv_heads=args.kv_heads, seq_len=args.seq_len, vocab_size=args.vocab_size,
                            mlp_width=args.mlp_width)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cpu_main(args: argparse.Namespace, cluster: Cluster) -> int:
    precisions = tuple(x for x in (args.precisions or ",".join(PRECISIONS)).split(",") if x)
    if not precisions or any(x not in PRECISIONS for x in precisions):
        raise ConfigError(f"--precisions must be a comma-separated subset of {','.join(PRECISIONS)}, got {args.precisions}")
    here = args.validate or args.cluster in (None, LOCAL_PRESET, str(CALIBRATED))
    if here and not has_accelerator():
        cluster, note = check_calibration(cluster, precisions)  # another CPU: re-measured per precision
        if note:
            print(note, flush=True)
    if args.speed_probe and args.cluster in (None, LOCAL_PRESET, str(CALIBRATED)) and not has_accelerator():
        cluster = probed(cluster)
    if args.validate:
        return validate(world=args.world, cluster=cluster, precisions=precisions, out=args.out)
    model = cpu_model(args)
    constraints = plan_gpu.constraints_from_args(args, args.world)
    estimates = rank_plans(default_config(model), world=args.world, global_batch_size=args.global_batch_size,
                           cluster=cluster, precisions=precisions)
    print(f"cluster: {cluster.name} ({cluster.source or 'preset'})")
    print(format_table(estimates, args.top or 15))
    priced = None
    if constraints != Constraints():
        matching = [e for e in estimates if constraints.admits(e.candidate)]
        priced = next((e for e in matching if e.feasible), matching[0] if matching else None)
        print("priced: " + (f"{priced.candidate.describe()}: {priced.step_time:.3f} s/step" if priced and priced.feasible
                            else f"{priced.candidate.describe()}: {priced.reason}" if priced
                            else "no plan matches --dp/--pp/--mp/..."))
    with open(args.out, "w") as f:
        json.dump({"cluster": json.loads(cluster.to_json()), "world": args.world, "model": args.model,
                   "global_batch_size": args.global_batch_size, "plans": [e.to_dict() for e in estimates]}, f, indent=2)
    print(f"wrote {args.out}")
    if args.json:
        best = next((e for e in estimates if e.feasible), None)
        plan_gpu.write_json(args.json, cpu_plan_json(best, model, args.world) if best else None,
                            cpu_plan_json(priced, model, args.world) if priced and priced.feasible else None,
                            len(estimates))
        print(f"wrote {args.json}")
    return 0


def cpu_plan_json(e: Estimate, model, world: int) -> dict:
    """An Estimate of the CPU planner as ``--json``'s PLAN (fixed per-action and per-step costs count as compute)."""
    shape = DecoderShape.from_config(model)
    c, b = e.candidate, e.breakdown
    per_gpu = e.tokens_per_sec / world / 1e12
    return {"dp": c.dp, "pp": c.pp, "mp": c.mp, "schedule": c.schedule, "stages_per_rank": c.stages_per_rank,
            "micro_batch_size": c.micro_batch_size, "activation_checkpointing": c.activation_checkpointing,
            "dp_mode": dp_mode(c), "step_time_s": e.step_time,
            "model_tflops_per_gpu": model_flops_per_token(shape) * per_gpu,
            "hardware_tflops_per_gpu": hardware_flops_per_token(shape, activation_checkpointing=c.activation_checkpointing)
            * per_gpu, "mfu": e.mfu, "memory_gib_per_gpu": e.memory_per_rank / 2**30, "fits": e.feasible,
            "breakdown": {"compute": b.compute + b.fixed, "bubble": b.bubble, "tp": b.tp_comm, "pp": b.pp_comm,
                          "dp_exposed": b.dp_comm, "optimizer": b.optimizer}}


def probed(cluster: Cluster) -> Cluster:
    """This machine's cluster rescaled to its speed now (runtime/commands/speed_probe.py)."""
    print("probing this machine's speed against its calibration ...", flush=True)
    measured = probe(cluster)
    if measured is None:
        print("speed probe: skipped (the cluster records no calibration points, or the probe failed)")
        return cluster
    ratio, line = measured
    print(line)
    return cluster.rescaled(ratio, line)


def auto_config(args: argparse.Namespace, argv: list[str], *, world: int) -> tuple[TrainConfig, Estimate | GpuEstimate, list[str]]:
    """``--auto``: the run ``args`` describe, trained with the planner's best plan for ``world`` ranks on
    this machine (pure computation, the same on every rank), and lines to print.

    Mesh, schedule, virtual stages, micro-batching and activation checkpointing are chosen; the
    precision too unless --precision is given. The global batch is --global-batch-size, else 32. On a
    CUDA machine the plan is priced on its GPU's preset; on CPU with this machine's calibration, in fp32
    only when the calibration is of another CPU (runtime/commands/precision_probe.py).
    """
    given = explicit_flags(argv)
    clashes = [flag for flag in AUTO_CHOSEN if flag in given]
    if clashes:
        raise ConfigError(f"--auto chooses {', '.join(AUTO_CHOSEN)}; drop {', '.join(clashes)} or drop --auto")
    gbs = args.global_batch_size or DEFAULT_GLOBAL_BATCH
    # The batch flags are the plan's to choose; the rest of the run is as given.
    base = build_config(argparse.Namespace(**{**vars(args), "global_batch_size": None}))
    precisions = (args.precision,) if "--precision" in given else tuple(PRECISIONS)
    notes = []
    try:
        cluster = resolve_cluster(None)
    except ValueError as e:
        raise ConfigError(f"--auto: {e}") from None
    if isinstance(cluster, GpuCluster):
        if cluster.world_error(world):
            raise ConfigError(f"--auto: {cluster.world_error(world)}")
        result = search(DecoderShape.from_config(base.model), world=world, global_batch_size=gbs, cluster=cluster,
                        precisions=precisions, validate=lambda c: plan_error(base, c))
        if result.best is None:
            raise ConfigError(f"--auto found no feasible plan for {world} GPUs on {cluster.name} ({result.reasons()})")
        best = result.best
        notes.append(f"auto plan priced on {cluster.name}")
    else:
        cluster, note = check_calibration(cluster, precisions, probe=False)
        if note and "--precision" not in given:
            precisions = ("fp32",)
            note += "; planning in fp32 only (give --precision, or run `python run.py calibrate` here)"
        notes += [note] if note else []
        best = best_plan(base, world=world, global_batch_size=gbs, cluster=cluster, precisions=precisions)
    cfg = apply_plan(base, best.candidate)
    if not args.logdir:
        cfg = with_default_logdir(cfg)
    validate_config(cfg, world_size=world)
    return cfg, best, notes
