"""``run.py plan`` on a GPU cluster: the analytic search (compiler/planner/gpu_search.py) for any decoder
shape and world size, a given plan priced beside the best, and ``--json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from compiler.planner.candidates import Constraints
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.gpu_search import GpuEstimate, SearchResult, search
from compiler.planner.gpu_time import EngineTraits
from compiler.planner.shape import DecoderShape, default_mlp_width, parameter_count
from compiler.schedules import SCHEDULES
from runtime.commands.flags import named_model
from runtime.config import ConfigError

SHAPE_FLAGS = ("layers", "d_model", "heads", "kv_heads", "mlp_width", "mlp", "seq_len", "vocab_size")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (priced in closed form, never built; default: --model's)")
    g.add_argument("--layers", type=int, help="transformer blocks")
    g.add_argument("--d-model", type=int, help="hidden width")
    g.add_argument("--heads", type=int, help="attention (query) heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    g.add_argument("--mlp-width", type=int, help="MLP hidden width (default 4 d for gelu, Llama's 8d/3 rule for swiglu)")
    g.add_argument("--mlp", choices=("gelu", "swiglu"), help="MLP kind: gelu (GPT-2: LayerNorm, biases, learned "
                   "positions) or swiglu (Llama: RMSNorm, no biases, RoPE, untied head)")
    g.add_argument("--seq-len", type=int, help="sequence length")
    g.add_argument("--vocab-size", type=int, help="vocabulary size")
    g = p.add_argument_group("a plan to price beside the best (what is left open is chosen for it)")
    g.add_argument("--dp", type=int)
    g.add_argument("--pp", type=int)
    g.add_argument("--mp", type=int)
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--schedule", choices=tuple(SCHEDULES))
    g.add_argument("--stages-per-rank", type=int)
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--dp-mode", help="none, fsdp, zero3, replicate or hsdp:N")
    g = p.add_argument_group("GPU clusters")
    g.add_argument("--max-mp", type=int, help="largest tensor-parallel degree (default: the devices of one node)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="price tensor-parallel plans with sequence parallelism (norms and activations sharded)")
    g.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="precision of data-parallel gradient communication")
    p.add_argument("--json", metavar="FILE", help='write {"best": PLAN, "priced": PLAN or null, "considered": N}')


def shape_from_args(args: argparse.Namespace) -> DecoderShape:
    """--model's shape (runtime/commands/flags.named_model) with the shape flags' overrides; --mlp swiglu
    makes a GPT-2 name Llama-like (RMSNorm, no biases, RoPE, untied) and --mlp gelu the reverse."""
    base = DecoderShape.from_config(named_model(args.model))
    kind = args.mlp or base.mlp
    if kind != base.mlp:
        base = DecoderShape.from_flags(layers=base.layers, d_model=base.d_model, heads=base.heads,
                                       seq_len=base.seq_len, vocab_size=base.vocab_size, mlp=kind)
    d, heads = args.d_model or base.d_model, args.heads or base.heads
    if d % heads:
        raise ConfigError(f"--heads {heads} must divide --d-model {d}")
    kv = args.kv_heads or (heads if base.kv_heads == base.heads else base.kv_heads)
    if heads % kv:
        raise ConfigError(f"--kv-heads {kv} must divide --heads {heads}")
    width = args.mlp_width or (default_mlp_width(kind, d) if args.d_model else base.mlp_width)
    return dataclasses.replace(base, layers=args.layers or base.layers, d_model=d, heads=heads, kv_heads=kv,
                               head_dim=d // heads, mlp_width=width, seq_len=args.seq_len or base.seq_len,
                               vocab_size=args.vocab_size or base.vocab_size,
                               context=args.seq_len or base.context)  # a model built from scratch: as the engine's


def constraints_from_args(args: argparse.Namespace, world: int) -> Constraints:
    for flag in ("dp", "pp", "mp", "micro_batch_size", "stages_per_rank", "max_mp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    mesh = [getattr(args, k) for k in ("dp", "pp", "mp")]
    if all(x is not None for x in mesh) and mesh[0] * mesh[1] * mesh[2] != world:
        raise ConfigError(f"--dp {mesh[0]} x --pp {mesh[1]} x --mp {mesh[2]} must equal --world {world}")
    mode = args.dp_mode
    if mode is not None and mode not in ("none", "fsdp", "zero3", "replicate") and not (
            mode.startswith("hsdp:") and mode[5:].isdigit()):
        raise ConfigError(f"--dp-mode must be none, fsdp, zero3, replicate or hsdp:N, got {mode}")
    return Constraints(dp=args.dp, pp=args.pp, mp=args.mp, micro_batch_size=args.micro_batch_size,
                       schedule=args.schedule, stages_per_rank=args.stages_per_rank,
                       activation_checkpointing=args.activation_checkpointing, dp_mode=mode)


def describe_shape(shape: DecoderShape) -> str:
    kv = f" ({shape.kv_heads} kv)" if shape.kv_heads != shape.heads else ""
    return (f"{shape.layers} layers, d {shape.d_model}, {shape.heads} heads{kv}, {shape.mlp} {shape.mlp_width}, "
            f"sequence {shape.seq_len}, vocabulary {shape.vocab_size}: {parameter_count(shape) / 1e9:.2f}B parameters")


def describe_estimate(e: GpuEstimate) -> str:
    b = e.breakdown
    fits = "" if e.fits else "  DOES NOT FIT"
    return (f"{e.candidate.describe()}: {e.step_time:.3f} s/step, {e.model_tflops_per_gpu:.1f} model TFLOP/s per GPU "
            f"(MFU {100 * e.mfu:.1f}%), {e.hardware_tflops_per_gpu:.1f} counting recompute, "
            f"{e.memory_bytes / 2**30:.1f} GiB per GPU{fits}\n"
            f"      compute {b.compute:.3f} s, bubble {b.bubble:.3f}, TP {b.tp:.3f}, PP {b.pp:.3f}, "
            f"DP exposed {b.dp_exposed:.3f}, optimizer {b.optimizer:.3f}")


def price_given(shape: DecoderShape, constraints: Constraints, **search_args) -> GpuEstimate | None:
    """The best plan within the user's constraints: one that fits if any does, else the fastest."""
    result = search(shape, constraints=constraints, **search_args)
    return result.best or search(shape, constraints=constraints, require_fit=False, **search_args).best


def write_json(path: str, best: dict | None, priced: dict | None, considered: int) -> None:
    with open(path, "w") as f:
        json.dump({"best": best, "priced": priced, "considered": considered}, f, indent=2)


def main(args: argparse.Namespace, cluster: GpuCluster) -> int:
    """Search, print, write --json. Raises ConfigError / ValueError on bad input."""
    world = args.world
    error = cluster.world_error(world)
    if error:
        raise ConfigError(error)
    shape = shape_from_args(args)
    constraints = constraints_from_args(args, world)
    precisions = tuple(x for x in (args.precisions or "bf16").split(",") if x)
    bad = [x for x in precisions if x not in cluster.peak_flops]
    if bad or not precisions:
        raise ConfigError(f"--precisions must be among {', '.join(cluster.peak_flops)}, got {args.precisions}")
    traits = EngineTraits(sequence_parallel=args.sequence_parallel, grad_reduce_bytes=4 if args.reduce_dtype == "fp32" else 2)
    common = dict(world=world, global_batch_size=args.global_batch_size, cluster=cluster, traits=traits,
                  precisions=precisions, max_mp=args.max_mp)
    print(f"cluster: {cluster.name}, {cluster.nodes_for(world)} node(s) x {cluster.devices_per_node} GPUs "
          f"({cluster.source or 'preset'})")
    print(f"model: {describe_shape(shape)}; global batch {args.global_batch_size} sequences")
    start = time.perf_counter()
    result: SearchResult = search(shape, keep=args.top or 5, **common)
    seconds = time.perf_counter() - start
    if result.best is None:
        print(f"no plan fits: {result.reasons()}")
    for i, e in enumerate(result.top, 1):
        print(f"{i:>3}. {describe_estimate(e)}")
    print(f"searched {result.considered:,} plans in {seconds:.1f} s ({result.priced:,} priced); "
          f"turned away: {result.reasons()}")
    priced = None
    if constraints != Constraints():
        priced = price_given(shape, constraints, **common)
        print("priced: " + (describe_estimate(priced) if priced else "no plan matches --dp/--pp/--mp/... here"))
        if priced and result.best:
            print(f"      the best plan is {priced.step_time / result.best.step_time:.2f}x as fast")
    if args.json:
        write_json(args.json, result.best.to_json() if result.best else None, priced.to_json() if priced else None,
                   result.considered)
        print(f"wrote {args.json}")
    return 0
