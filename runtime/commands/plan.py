"""``python run.py plan``: the planner's best plans for a model, world size and cluster (this CPU machine or a
GPU cluster: one cost model), why they win, a given layout priced as the run it names, and ``--auto``
training with the best one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from compiler.lora import LoraConfig
from compiler.planner.advice import MEMORY_BINDS_BELOW, binding_constraint, cheapest_fit, why_slower
from compiler.planner.auto import DEFAULT_GLOBAL_BATCH, ENGINE_RUNS
from compiler.planner.candidates import Constraints
from compiler.planner.cluster import CALIBRATED, LOCAL_PRESET, Cluster, preset_names, resolve_cluster
from compiler.planner.engines import THIS_ENGINE
from compiler.planner.precision_probe import check_calibration
from compiler.planner.search import Estimate, SearchResult, constraints_error, search, search_bounds
from compiler.planner.shape import DecoderShape
from compiler.precisions import PRECISIONS
from models import MODEL_NAMES, named_config, spec_of
from runtime.commands.flag_groups import add_lora_flags, command_parser
from runtime.commands.flags import (
    default_config,
    fine_tuning_mtp_error,
    lora_config,
    named_model,
)
from runtime.commands.plan_flags import add_flags, constraints_from_args, describe_estimate, describe_shape, shape_from_args
from runtime.commands.plan_reproduce import print_reproduction
from runtime.config import ConfigError, check_lora, plan_checker
from runtime.device import has_accelerator
from runtime.observe.alignment import head_aligned, padded_vocabulary

# What a priced layout takes from the search's limits where the user left it open.
HELD_FROM_LIMITS = ("cp", "ep", "chunked_loss", "ac_modes", "max_mp", "max_cp")


def build_arg_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "run.py plan",
        "The fastest plans (dp x pp x mp x cp, ep, schedule, v, micro-batching, precision, activation "
        "checkpointing, DP mode, SP) for a model on a cluster: this CPU machine (its calibration) or a GPU "
        "cluster (a preset or a cluster file), any decoder shape up to tens of thousands of GPUs, priced "
        "in closed form by one cost model. Names what binds the best plan and why the next ones lose; "
        "--dp/--pp/--mp/... price the run they name, searching what is left open.")
    p.add_argument("--world", type=int, help="number of ranks (GPUs); required unless --reproduce")
    p.add_argument("--model", choices=tuple(MODEL_NAMES), default="small",
                   help="named model (see run.py --help); the shape flags below override it")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH, help="sequences per optimizer step")
    p.add_argument("--cluster", help=f"cluster JSON or preset ({', '.join(preset_names())}); default: on a CUDA "
                                     f"machine its GPU's preset, else the file `run.py calibrate` wrote ({CALIBRATED}) "
                                     f"if any, else {LOCAL_PRESET}")
    p.add_argument("--precisions", help="comma-separated precisions to consider (default: fp32,bf16,fp16 on CPU, "
                                        "bf16 on GPU clusters)")
    p.add_argument("--top", type=int, help="plans to list (default 15 on CPU, 5 on GPU clusters)")
    p.add_argument("--out", default="plan.json", help="CPU: where to write every plan with its estimate")
    p.add_argument("--reproduce", metavar="FILE", nargs="*",
                   help="price published runs at their layouts (compiler/published/*.json; no FILE: all of them)")
    p.add_argument("--fit", action="store_true", help="with --reproduce: refit the GEMM efficiency constant to the "
                                                      "in-sample (fitted) tables given")
    add_flags(p)
    add_lora_flags(p)
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_arg_parser().parse_args(argv)
        if args.reproduce is not None:
            return print_reproduction(args)
        if args.world is None or args.world < 1 or args.global_batch_size < 1:
            raise ConfigError("--world and --global-batch-size must be positive (--world is required)")
        cluster = resolve_cluster(args.cluster)
        if not cluster.is_gpu:
            cluster = this_machine(args, cluster)
        return plan(args, cluster)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def precisions_of(args: argparse.Namespace, cluster: Cluster) -> tuple[str, ...]:
    default = "bf16" if cluster.is_gpu else ",".join(PRECISIONS)
    precisions = tuple(x for x in (args.precisions or default).split(",") if x)
    known = cluster.device.peak_flops if cluster.is_gpu else PRECISIONS
    if not precisions or any(x not in known or x not in PRECISIONS for x in precisions):
        raise ConfigError(f"--precisions must be a comma-separated subset of {','.join(PRECISIONS)}, got {args.precisions}")
    return precisions


def this_machine(args: argparse.Namespace, cluster: Cluster) -> Cluster:
    """Planning for this CPU: re-timed on another CPU generation (compiler/planner/precision_probe.py)."""
    if args.cluster in (None, LOCAL_PRESET, str(CALIBRATED)) and not has_accelerator():
        cluster, note = check_calibration(cluster, precisions_of(args, cluster))
        if note:
            print(note, flush=True)
    return cluster


def plan(args: argparse.Namespace, cluster: Cluster) -> int:
    """Search, print (best plans, binding constraint, runners-up, a priced layout, advice), write --json/--out."""
    world = args.world
    if cluster.world_error(world):
        raise ConfigError(cluster.world_error(world))
    given = constraints_from_args(args, world)
    precisions = precisions_of(args, cluster)
    traits = dataclasses.replace(THIS_ENGINE, grad_reduce_bytes=4 if args.reduce_dtype == "fp32" else 2)
    validate_plan = None
    searched = {"headroom": given.headroom, "max_mp": given.max_mp, "fp8": given.fp8, "fp8_all_gather": given.fp8_all_gather,
                "cp_gather": given.cp_gather}
    limits = Constraints(max_cp=given.max_cp, max_ep=given.max_ep, **searched)
    if cluster.is_gpu:
        shape = shape_from_args(args)
    else:  # this machine: the engine's model, and what the engine runs here as it would run it
        base = default_config(cpu_model(args))
        shape = DecoderShape.from_config(base.model)
        validate_plan = plan_checker(base)
        limits = dataclasses.replace(ENGINE_RUNS, **searched)

    limits = holding_the_layout(limits, given, shape, cluster, world=world)
    if error := constraints_error(shape, cluster, limits):
        raise ConfigError(error)
    lora = planned_lora(args)

    def run(constraints: Constraints, ranks: int, model: DecoderShape | None = None, **kw) -> SearchResult:
        return search(model or shape, world=ranks, global_batch_size=args.global_batch_size, cluster=cluster, traits=traits,
                      precisions=precisions, constraints=constraints, validate=validate_plan, lora=lora, **kw)

    print(f"cluster: {cluster.name}, {cluster.topology.nodes_for(world)} node(s) x {cluster.devices_per_node} "
          f"({cluster.source or 'preset'})")
    print(f"model: {describe_shape(shape)}; global batch {args.global_batch_size} sequences"
          + (f"; LoRA rank {lora.rank} on {','.join(lora.targets)}, the rest frozen" if lora else ""))
    start = time.perf_counter()
    result = run(limits, world, keep=args.top or (5 if cluster.is_gpu else 15), collect=not cluster.is_gpu)
    seconds = time.perf_counter() - start
    report = {"binding": None, "advice": None, "vocabulary": None}
    if result.best is None:
        print(f"no plan fits: {result.reasons()}")
    else:
        for i, e in enumerate(result.top, 1):
            print(f"{i:>3}. {describe_estimate(e)}" + (f"\n      loses: {why_slower(e, result.best)}" if i > 1 else ""))
        # Only plans fast enough to make memory the binding constraint are searched for.
        unconstrained = run(limits, world, require_fit=False,
                            faster_than=MEMORY_BINDS_BELOW * result.best.step_time).best
        report["binding"] = binding_constraint(result.best, unconstrained)
        print(f"binding constraint: {report['binding']}")
    print(f"searched {result.considered:,} plans in {seconds:.1f} s ({result.priced:,} priced); "
          f"turned away: {result.reasons()}")
    priced = None
    if given.fixes_layout():
        held = dataclasses.replace(given, **{k: getattr(limits, k) for k in HELD_FROM_LIMITS
                                             if getattr(limits, k) is not None and getattr(given, k) is None})
        priced = run(held, world).best
        unfitted = None if priced else run(held, world, require_fit=False)  # searched again only when none fits
        priced = priced or unfitted.best
        print("priced: " + (describe_estimate(priced) if priced
                            else f"no plan matches --dp/--pp/--mp/... here: {unfitted.reasons()}"))
        if priced and result.best:
            print(f"      the best plan is {priced.step_time / result.best.step_time:.2f}x as fast")
    stuck = result.best is None or (priced is not None and not priced.fits)
    if stuck:
        fix = cheapest_fit(lambda c, ranks: run(c, ranks), given if priced else limits, world,
                           has_experts=shape.experts is not None)
        report["advice"] = (f"{fix.what}: {fix.result.plan.describe()}, {fix.result.step_time:.3f} s/step, "
                            f"{fix.result.memory_per_rank / 2**30:.1f} GiB" if fix else "no change tried fits")
        print(f"cheapest change that fits: {report['advice']}")
    if cluster.is_gpu and result.best is not None:
        report["vocabulary"] = padded_vocabulary_line(shape, result.best, lambda padded: run(limits, world, model=padded))
        if report["vocabulary"]:
            print(report["vocabulary"])
    if not cluster.is_gpu:
        with open(args.out, "w") as f:
            json.dump({"cluster": json.loads(cluster.to_json()), "world": world, "model": args.model,
                       "global_batch_size": args.global_batch_size, "plans": [e.to_dict() for e in result.every]}, f,
                      indent=2)
        print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"best": result.best.to_json() if result.best else None,
                       "priced": priced.to_json() if priced else None, "considered": result.considered, **report},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


def holding_the_layout(limits: Constraints, given: Constraints, shape: DecoderShape, cluster: Cluster, *,
                       world: int) -> Constraints:
    """``limits`` with the search's bounds raised to the mp and cp the user named: the best plans are searched in a
    space that holds the priced layout (else a --cp or --mp past the bounds could price faster than the best)."""
    max_mp, max_cp = search_bounds(shape, cluster, limits, world=world)
    return dataclasses.replace(limits, max_mp=max(max_mp, given.mp or 1), max_cp=max(max_cp, given.cp or 1))


def planned_lora(args: argparse.Namespace) -> LoraConfig | None:
    """``--lora-*`` as training reads them (the targets by --model's family): the model frozen, the adapters trained,
    priced by the memory model (compiler/planner/pricer.py); None without --lora-rank / --lora-from."""
    model = named_model(args.model)
    lora = lora_config(args, model)
    if lora is not None:
        check_lora(lora, model, precision=None)  # train's checks; the precision is searched
        if args.mtp_depth:
            raise fine_tuning_mtp_error(["--lora-rank"], args.mtp_depth)
    return lora


def padded_vocabulary_line(shape: DecoderShape, best: Estimate, search_padded) -> str | None:
    """Where the best plan's LM head runs on unaligned GPU kernels (runtime/observe/alignment.py): the best plan
    with the vocabulary padded to a multiple of 64 x mp, searched again (``search_padded(shape)``)."""
    c = best.plan
    if head_aligned(shape.vocab_size, mp=c.mp, itemsize=PRECISIONS[c.precision].dtype.itemsize):
        return None
    padded = padded_vocabulary(shape.vocab_size, c.mp)
    faster = search_padded(dataclasses.replace(shape, vocab_size=padded)).best
    if faster is None:
        return None
    return (f"padded vocabulary (a model trained from scratch: the head's rows of {shape.vocab_size:,} words are "
            f"not 16-byte aligned): --vocab-size {padded}: {faster.plan.describe()}, {faster.step_time:.3f} "
            f"s/step, {best.step_time / faster.step_time:.2f}x as fast")


def cpu_model(args: argparse.Namespace):
    """The engine's model of --model with the shape flags' overrides (planning for this machine: a model the
    engine builds)."""
    base = named_model(args.model)
    kind = spec_of(base).architecture.mlp
    if args.mlp and args.mlp != kind:
        raise ConfigError(f"--mlp {args.mlp}: --model {args.model} has a {kind} MLP; on this machine's planner pick a "
                          f"--model of the family you mean (gelu: GPT-2 sizes, swiglu: llama3-*), or plan for a GPU "
                          f"cluster (--cluster {' or '.join(n for n in preset_names() if n != LOCAL_PRESET)})")
    if args.experts:
        raise ConfigError("--experts describes a hypothetical mixture for a GPU cluster's planner; on this machine "
                          "plan a mixture-of-experts --model (qwen3-moe-*, mixtral-*) with its shape flags")
    try:
        cfg = named_config(args.model, n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                           n_kv_heads=args.kv_heads, seq_len=args.seq_len, vocab_size=args.vocab_size,
                           mlp_width=args.mlp_width)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(cfg, mtp_depth=args.mtp_depth) if args.mtp_depth else cfg
