"""``run.py plan``'s flags as typed objects: the model's shape (any family, dense or mixture of experts) and
the plan the user fixes (``Constraints``), and the lines that describe them."""

from __future__ import annotations

import argparse
import dataclasses

from compiler.parallel_plan import ParallelPlan, dp_shard_of_mode, is_dp_mode
from compiler.planner.candidates import Constraints
from compiler.planner.search import Estimate
from compiler.planner.shape import DecoderShape, activated_parameter_count, default_mlp_width, parameter_count
from compiler.schedules import zero3_problem
from models.spec import Experts
from runtime.commands.flag_groups import add_model_shape_flags
from runtime.commands.flag_table import add_plan_flags, fp8_choices
from runtime.commands.flags import named_model
from runtime.config import ConfigError, check_fp8_all_gather

SHAPE_FLAGS = ("layers", "d_model", "heads", "kv_heads", "mlp_width", "mlp", "seq_len", "vocab_size", "experts",
               "top_k", "expert_width", "shared_experts", "first_dense_layers")
POSITIVE = ("dp", "pp", "mp", "cp", "ep", "micro_batch_size", "stages_per_rank", "max_mp", "max_cp", "max_ep")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (priced in closed form, never built; default: --model's)")
    add_model_shape_flags(g)
    g.add_argument("--mlp", choices=("gelu", "swiglu"), help="MLP kind: gelu (GPT-2: LayerNorm, biases, learned "
                   "positions) or swiglu (Llama: RMSNorm, no biases, RoPE, untied head)")
    g.add_argument("--experts", type=int, help="a mixture of experts: routed experts per block")
    g.add_argument("--top-k", type=int, help="experts each token is routed to (with --experts)")
    g.add_argument("--expert-width", type=int, help="one expert's hidden width (default --mlp-width)")
    g.add_argument("--shared-experts", type=int, default=0, help="experts every token passes through")
    g.add_argument("--first-dense-layers", type=int, default=0, help="the first K blocks keep the dense MLP")
    g.add_argument("--mtp-depth", type=int, default=0, metavar="D",
                   help="multi-token-prediction depths on the last stage (a block, a projection and the head each), "
                        "priced as given, never searched")
    g = p.add_argument_group("a plan to price (what is left open is searched and printed)")
    add_plan_flags(g, ("dp", "pp", "mp", "cp", "cp_gather", "ep", "micro_batch_size", "schedule", "stages_per_rank", "ac",
                       "sequence_parallel", "fp8", "fp8_all_gather"), searched=True)
    g.add_argument("--no-activation-checkpointing", dest="ac", action="store_const", const="none",
                   help="hold activation checkpointing off")
    g.add_argument("--dp-mode", help="none, fsdp, zero3, replicate or hsdp:N (FSDP runs over dp x cp: at --dp 1 "
                                     "with --cp > 1, fsdp or zero3)")
    g.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="hold the chunked vocabulary-parallel loss on or off (default: searched)")
    g = p.add_argument_group("search bounds")
    g.add_argument("--max-mp", type=int, help="largest tensor-parallel degree (default: the devices of one node)")
    g.add_argument("--max-cp", type=int, help="largest context-parallel degree (default: T / 8192, at most 16)")
    g.add_argument("--max-ep", type=int, help="largest expert-parallel degree (default: any)")
    g.add_argument("--headroom", type=float, default=0.0, help="fraction of device memory to leave free")
    add_plan_flags(g, ("reduce_dtype",))
    p.add_argument("--json", metavar="FILE", help='write {"best": PLAN, "priced": PLAN or null, "considered": N, ...}')


def check_positive(args: argparse.Namespace) -> None:
    for flag in (*SHAPE_FLAGS, *POSITIVE):
        value = getattr(args, flag, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1 and flag not in (
                "shared_experts", "first_dense_layers"):
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.mtp_depth < 0:
        raise ConfigError(f"--mtp-depth must be >= 0, got {args.mtp_depth}")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom must be a fraction in [0, 1), got {args.headroom}")


def _experts(args: argparse.Namespace, base: DecoderShape, width: int, layers: int) -> Experts | None:
    if args.experts is None:
        if args.top_k or args.expert_width:
            raise ConfigError("--top-k and --expert-width need --experts N")
        return base.experts
    if not args.top_k or not 1 <= args.top_k <= args.experts:
        raise ConfigError(f"--top-k must be between 1 and --experts {args.experts}, got {args.top_k}")
    if args.first_dense_layers >= layers:
        raise ConfigError(f"--first-dense-layers {args.first_dense_layers} must be below the {layers} layers")
    return Experts(args.experts, args.top_k, args.expert_width or width, args.shared_experts,
                   dense_layers=tuple(range(args.first_dense_layers)))


def shape_from_args(args: argparse.Namespace) -> DecoderShape:
    """--model's shape (its family's spec) with the shape flags' overrides; --mlp swiglu makes a GPT-2 name
    Llama-like (RMSNorm, no biases, RoPE, untied) and --mlp gelu the reverse."""
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
    layers = args.layers or base.layers
    latent = base.latent and dataclasses.replace(base.latent, n_heads=heads)  # its head dimensions are its own
    return dataclasses.replace(base, layers=layers, d_model=d, heads=heads, kv_heads=kv, latent=latent,
                               head_dim=d // heads if (args.d_model or args.heads) and not latent else base.head_dim,
                               mlp_width=width, seq_len=args.seq_len or base.seq_len,
                               vocab_size=args.vocab_size or base.vocab_size,
                               experts=_experts(args, base, width, layers), mtp_depth=args.mtp_depth)


def constraints_from_args(args: argparse.Namespace, world: int) -> Constraints:
    check_positive(args)
    mesh = [getattr(args, k) or (1 if k == "cp" else None) for k in ("dp", "pp", "mp", "cp")]
    if all(x is not None for x in mesh) and mesh[0] * mesh[1] * mesh[2] * mesh[3] != world:
        raise ConfigError(f"--dp {mesh[0]} x --pp {mesh[1]} x --mp {mesh[2]} x --cp {mesh[3]} must equal --world {world}")
    mode = args.dp_mode
    if mode is not None and not is_dp_mode(mode):
        raise ConfigError(f"--dp-mode must be none, fsdp, zero3, replicate or hsdp:N, got {mode}")
    if mode == "zero3" and args.schedule and (problem := zero3_problem(args.schedule, reshard_after_forward=True)):
        raise ConfigError(f"--dp-mode zero3: {problem}")
    if args.fp8_all_gather:
        check_fp8_all_gather(_loosest_layout(args, world))
    return Constraints(dp=args.dp, pp=args.pp, mp=args.mp, cp=args.cp, ep=args.ep,
                       micro_batch_size=args.micro_batch_size, schedule=args.schedule,
                       stages_per_rank=args.stages_per_rank, ac=args.ac, dp_mode=mode,
                       sequence_parallel=args.sequence_parallel, chunked_loss=args.chunked_loss,
                       max_mp=args.max_mp, max_cp=args.max_cp, max_ep=args.max_ep, headroom=args.headroom,
                       fp8=fp8_choices(args.fp8),
                       fp8_all_gather=(False, True) if args.fp8_all_gather is None else (args.fp8_all_gather,),
                       cp_gather=None if args.cp_gather is None else (args.cp_gather,))


def _loosest_layout(args: argparse.Namespace, world: int) -> ParallelPlan:
    """The plan the flags fix with --fp8-all-gather, a data-parallel dimension left open at what admits the flag:
    the ranks the fixed dimensions leave (dp first, then cp), sharded unless --dp-mode says otherwise (``none``: dp
    and cp 1). Train's check of it fails when no layout the flags leave open could run the flag."""
    if args.dp_mode == "none":
        return ParallelPlan(fp8=args.fp8, fp8_all_gather=True)
    left = max(1, world // ((args.pp or 1) * (args.mp or 1)))
    dp = args.dp or max(1, left // (args.cp or 1))
    cp = args.cp or max(1, left // dp)
    return ParallelPlan(dp=dp, cp=cp, dp_shard=dp_shard_of_mode(args.dp_mode or "fsdp"), fp8=args.fp8,
                        fp8_all_gather=True)



def describe_shape(shape: DecoderShape) -> str:
    kv = f" ({shape.kv_heads} kv)" if shape.kv_heads != shape.heads else ""
    e = shape.experts
    mlp = (f"{e.count} experts of {e.width} (top {e.top_k}{f', {e.shared} shared' if e.shared else ''}"
           f"{f', first {len(e.dense_layers)} dense' if e.dense_layers else ''})" if e else f"{shape.mlp} {shape.mlp_width}")
    active = f", {activated_parameter_count(shape) / 1e9:.2f}B activated" if e else ""
    return (f"{shape.layers} layers, d {shape.d_model}, {shape.heads} heads{kv}, {mlp}, sequence {shape.seq_len}, "
            f"vocabulary {shape.vocab_size}: {parameter_count(shape) / 1e9:.2f}B parameters{active}")


def describe_estimate(e: Estimate) -> str:
    b = e.breakdown
    fits = "" if e.fits else "  DOES NOT FIT"
    parts = ", ".join(f"{name} {getattr(b, key):.3f}" for name, key in (
        ("bubble", "bubble"), ("TP", "tp"), ("CP", "cp"), ("EP", "ep"), ("PP", "pp"), ("DP exposed", "dp_exposed"),
        ("optimizer", "optimizer"), ("fixed", "fixed")) if getattr(b, key) or key in ("bubble", "dp_exposed"))
    return (f"{e.plan.describe()}: {e.step_time:.3f} s/step, {e.model_tflops_per_gpu:.1f} model TFLOP/s per "
            f"device (MFU {100 * e.mfu:.1f}%), {e.memory_per_rank / 2**30:.2f} GiB per rank{fits}\n"
            f"      compute {b.compute:.3f} s, {parts}")
