"""``--auto``: the planner's best plan for this world, applied to the run the other flags describe. The training
command imports this only when ``--auto`` is given, so a plain run loads no search."""

from __future__ import annotations

import argparse
import dataclasses

from compiler.parallel_plan import ParallelPlan
from compiler.planner.auto import DEFAULT_GLOBAL_BATCH, NoPlanError, best_plan
from compiler.planner.cluster import resolve_cluster
from compiler.planner.precision_probe import check_calibration
from compiler.planner.search import Estimate
from compiler.precisions import PRECISIONS
from runtime.commands.flag_table import FP8_ANY, fp8_choices
from runtime.commands.flags import AUTO_CHOSEN, build_config, explicit_flags, with_default_logdir
from runtime.config import ConfigError, TrainConfig, check_cp_gather, check_fp8_all_gather, plan_checker
from runtime.config import validate as validate_config


def auto_config(args: argparse.Namespace, argv: list[str], *, world: int) -> tuple[TrainConfig, Estimate, list[str]]:
    """``--auto``: the run ``args`` describe, trained with the planner's best plan for ``world`` ranks on this
    machine (pure computation, the same on every rank), and lines to print.

    Mesh, schedule, virtual stages, micro-batching and activation checkpointing are chosen; the precision too
    unless --precision is given; an FP8 recipe only under --fp8 any (--fp8 X is held); --fp8-all-gather under
    tensorwise FP8 with sharded data parallelism (held on when given); --cp-gather latent or kv for latent
    attention under context parallelism without FP8 (held when given). The global batch is
    --global-batch-size, else 32. One planner for every device: on a CUDA machine the plan is priced on its GPU's
    preset, on CPU with this machine's calibration (in fp32 only when the calibration is of another CPU,
    compiler/planner/precision_probe.py).
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
    if cluster.is_gpu:
        if cluster.world_error(world):
            raise ConfigError(f"--auto: {cluster.world_error(world)}")
        precisions = tuple(p for p in precisions if p in cluster.device.peak_flops)
    else:
        cluster, note = check_calibration(cluster, precisions, probe=False)
        if note and "--precision" not in given:
            precisions = ("fp32",)
            note += "; planning in fp32 only (give --precision, or run `python run.py calibrate` here)"
        notes += [note] if note else []
    # What the user gave beside --auto is held: sequence parallelism, context and expert parallelism.
    held = {"sequence_parallel": True} if "--sequence-parallel" in given else {}
    held.update({dim: getattr(args, dim) for dim in ("cp", "ep") if f"--{dim}" in given})
    if args.fp8:  # --fp8 X holds the recipe, --fp8 any lets the planner choose one or none
        held["fp8"] = fp8_choices(args.fp8)
    if "--fp8-all-gather" in given:  # held on (train's check, at the most data parallelism --auto could choose)
        check_fp8_all_gather(ParallelPlan(dp=max(1, world // args.cp), cp=args.cp, fp8=args.fp8, fp8_all_gather=True))
        held["fp8_all_gather"] = (True,)  # else the planner gathers in FP8 where it may (tensorwise, sharded)
    if "--cp-gather" in given:  # held (train's check; --fp8 any may plan no FP8); else the planner prices both
        check_cp_gather(dataclasses.replace(base.plan, fp8=None if args.fp8 == FP8_ANY else args.fp8), base.model)
        held["cp_gather"] = (args.cp_gather,)
    try:
        best = best_plan(base.model, world=world, global_batch_size=gbs, cluster=cluster, precisions=precisions,
                         validate=plan_checker(base), held=held, lora=base.lora)
    except NoPlanError as e:
        raise ConfigError(str(e)) from None
    notes.append(f"auto plan priced on {cluster.name}" + (f", holding {', '.join(f'{k}={v}' for k, v in held.items())}"
                                                          if held else ""))
    # The planner chooses the layout; what it does not price (a manual split, the gradients' dtype) stays the user's.
    cfg = dataclasses.replace(base, plan=dataclasses.replace(best.plan, split=base.plan.split,
                                                             reduce_dtype=base.plan.reduce_dtype))
    if not args.logdir:
        cfg = with_default_logdir(cfg)
    validate_config(cfg, world_size=world)
    return cfg, best, notes
