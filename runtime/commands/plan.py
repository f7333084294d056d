"""``python run.py plan``: rank every (dp, pp, mp, schedule, v, micro-batching, precision, AC) plan
for a world size on a cluster, and ``--auto`` training with the best one."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from compiler.planner.cluster import CALIBRATED, LOCAL_PRESET, Cluster, preset_names, resolve_cluster
from compiler.planner.search import Estimate
from compiler.precisions import PRECISIONS
from models import MODEL_NAMES
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
from runtime.commands.speed_probe import probe
from runtime.config import ConfigError, TrainConfig, apply_plan
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="run.py plan", formatter_class=HelpFormatter,
        description="Rank every (dp, pp, mp, schedule, v, micro-batching, precision, activation checkpointing) "
                    "plan for a world size by predicted step time on a cluster; infeasible plans are listed with "
                    "the reason. Writes every plan to --out.")
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--model", choices=tuple(MODEL_NAMES), default="small", help="named model size (see run.py --help)")
    p.add_argument("--seq-len", type=int, help="override the model's sequence length")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH, help="samples per optimizer step")
    p.add_argument("--cluster", help=f"cluster JSON or preset ({', '.join(preset_names())}); default: the file "
                                     f"`run.py calibrate` wrote ({CALIBRATED}) if any, else {LOCAL_PRESET}")
    p.add_argument("--speed-probe", action="store_true",
                   help="planning for this machine, first re-run two of calibration's recorded engine runs "
                        "(~30 s) and rescale the calibration by their speed now (runtime/commands/speed_probe.py)")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated precisions to consider")
    p.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    p.add_argument("--out", default="plan.json", help="where to write every plan with its estimate")
    p.add_argument("--validate", action="store_true",
                   help="run every feasible mesh of the tiny and small models on this machine and compare "
                        "predicted with measured step times")
    args = p.parse_args(argv)
    if args.world < 1 or args.global_batch_size < 1:
        print("error: --world and --global-batch-size must be positive", file=sys.stderr)
        return 2
    try:
        cluster = resolve_cluster(args.cluster)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    precisions = tuple(x for x in args.precisions.split(",") if x)
    if not precisions or any(x not in PRECISIONS for x in precisions):
        print(f"error: --precisions must be a comma-separated subset of {','.join(PRECISIONS)}, got {args.precisions}",
              file=sys.stderr)
        return 2
    if args.speed_probe and args.cluster in (None, LOCAL_PRESET, str(CALIBRATED)) and not has_accelerator():
        cluster = probed(cluster)
    if args.validate:
        return validate(world=args.world, cluster=cluster, precisions=precisions, out=args.out)
    estimates = rank_plans(default_config(named_model(args.model, args.seq_len)), world=args.world,
                           global_batch_size=args.global_batch_size, cluster=cluster, precisions=precisions)
    print(f"cluster: {cluster.name} ({cluster.source or 'preset'})")
    print(format_table(estimates, args.top))
    with open(args.out, "w") as f:
        json.dump({"cluster": json.loads(cluster.to_json()), "world": args.world, "model": args.model,
                   "global_batch_size": args.global_batch_size, "plans": [e.to_dict() for e in estimates]}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


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


def auto_config(args: argparse.Namespace, argv: list[str], *, world: int) -> tuple[TrainConfig, Estimate]:
    """``--auto``: the run ``args`` describe, trained with the planner's best plan for ``world`` ranks on
    this machine (pure computation, the same on every rank).

    Mesh, schedule, virtual stages, micro-batching and activation checkpointing are chosen; the
    precision too unless --precision is given. The global batch is --global-batch-size, else 32.
    """
    given = explicit_flags(argv)
    clashes = [flag for flag in AUTO_CHOSEN if flag in given]
    if clashes:
        raise ConfigError(f"--auto chooses {', '.join(AUTO_CHOSEN)}; drop {', '.join(clashes)} or drop --auto")
    gbs = args.global_batch_size or DEFAULT_GLOBAL_BATCH
    # The batch flags are the plan's to choose; the rest of the run is as given.
    base = build_config(argparse.Namespace(**{**vars(args), "global_batch_size": None}))
    precisions = (args.precision,) if "--precision" in given else tuple(PRECISIONS)
    best = best_plan(base, world=world, global_batch_size=gbs, cluster=resolve_cluster(None), precisions=precisions)
    cfg = apply_plan(base, best.candidate)
    if not args.logdir:
        cfg = with_default_logdir(cfg)
    validate_config(cfg, world_size=world)
    return cfg, best
