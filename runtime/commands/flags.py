"""Command-line flags -> TrainConfig, in exactly one place. Flags exist only at the process boundary:
inside, everything passes the typed config (runtime/config.py) and plan objects."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from compiler.parallelize.activation_checkpointing import AC_MODES
from compiler.precisions import PRECISIONS, default_precision
from compiler.schedules import DEFAULT_SCHEDULE, SCHEDULES
from models import FAMILIES, MODEL_NAMES, named_config, spec_of
from runtime.checkpoint.hf_weights import read_hf_model, run_model_config, run_name
from runtime.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DataParallelConfig,
    GuardConfig,
    MeshShape,
    MetricsConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    check_world,
    default_stages_per_rank,
    validate,
)
from runtime.device import DEVICE_CHOICES, has_fast_bf16, resolve_device_type
from runtime.distributed.process_group import DEFAULT_COLLECTIVE_TIMEOUT_S
from runtime.engine.data import DATA_FORMATS, TOKEN_DTYPES

DEFAULT_MODEL = "tiny"

# The flags --auto chooses (the planner's plan): giving one with --auto is an error.
AUTO_CHOSEN = ("--dp", "--pp", "--mp", "--dp-shard", "--reshard-after-forward", "--schedule", "--stages-per-rank",
               "--microbatches", "--micro-batch-size", "--activation-checkpointing")


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse would print a usage block and exit on every rank; raise instead, so that run.py prints
    one line on rank 0 and every rank exits with the same code."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except for flags whose absence means 'derived' (None) or 'off' (False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str = "run.py") -> argparse.ArgumentParser:
    p = _OneLineErrorParser(
        prog=prog,
        description="Train a GPT on a (dp, pp, mp) mesh: traced pipeline stages, DTensor tensor "
        "parallelism, FSDP data parallelism, overlapped pipeline schedules and mixed precision. "
        "Launch with `torchrun --nproc_per_node=N run.py ...`; without torchrun it runs as one process. "
        "Subcommands: study, plan, calibrate, export, eval, generate, data-benchmark (each has --help).",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("mesh (dp x pp x mp must equal the number of processes)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree (FSDP replicas)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (ranks per pipeline)")
    g.add_argument("--mp", type=int, default=1, help="model (tensor) parallel degree")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where the ranks compute: cuda (one GPU per rank, NCCL), cpu (gloo, also on a GPU machine), "
                        "auto = the accelerator when there is one, else the CPU")
    g = p.add_argument_group("data parallelism")
    g.add_argument("--dp-shard", type=int,
                   help="ranks a parameter is sharded over, a divisor of --dp (default --dp: FSDP); 1 = replicate "
                        "(every rank holds the whole stage, gradients all-reduced, like DDP); between: HSDP, "
                        "sharded within groups of N replicas and replicated across them")
    g.add_argument("--reshard-after-forward", action="store_true",
                   help="free gathered parameters after each forward and gather them again for backward (ZeRO-3 "
                        "memory, one more all-gather per micro-batch); default: keep them gathered for the step")
    g.add_argument("--reduce-dtype", choices=tuple(PRECISIONS), default="fp32",
                   help="precision in which data-parallel gradients are communicated (FSDP MixedPrecisionPolicy); "
                        "parameters and optimizer state stay fp32")

    p.add_argument("--auto", action="store_true",
                   help="let the planner choose mesh, schedule, v, micro-batching, activation checkpointing (and "
                        "precision unless --precision is given) for this world size; see `run.py plan`")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(MODEL_NAMES), metavar="NAME",
                   help=f"named size of a model family (default: {DEFAULT_MODEL}; with --init-from FOLDER, the folder's "
                        "model): " + "; ".join(s.description for s in FAMILIES.values()))
    g.add_argument("--layers", type=int, help="override the number of transformer blocks")
    g.add_argument("--d-model", type=int, help="override the hidden width")
    g.add_argument("--heads", type=int, help="override the number of attention heads")
    g.add_argument("--kv-heads", type=int,
                   help="override the number of key/value heads (grouped-query attention; llama3 models)")
    g.add_argument("--seq-len", type=int, help="override the sequence length (tokens per sample)")
    g.add_argument("--vocab-size", type=int, help="override the vocabulary size (>= 256 for byte-level text)")
    g.add_argument("--mlp-width", type=int,
                   help="override the MLP hidden width (default: the family's rule, 4 x d-model for GPT-2, "
                        "Llama's SwiGLU rule)")
    g.add_argument("--untie-embeddings", action="store_true",
                   help="give the LM head its own weight instead of reusing the token embedding (GPT-2 ties them)")

    g = p.add_argument_group("pipeline")
    g.add_argument("--schedule", choices=tuple(SCHEDULES), default=DEFAULT_SCHEDULE,
                   help="pipeline schedule; naive = stop-and-wait, one micro-batch at a time")
    g.add_argument("--stages-per-rank", type=int,
                   help="virtual stages v per pp rank (default: the schedule's, e.g. 2 for interleaved-1f1b, when "
                        "pp > 1; else 1)")
    g.add_argument("--microbatches", type=int,
                   help="micro-batches per step per dp replica (default: global batch / (micro-batch size x dp), or 2 x pp)")
    g.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per optimizer step over all replicas; must equal micro-batch size x microbatches x dp")
    g.add_argument("--split", default="auto",
                   help="stage split: auto (balance estimated per-layer cost), uniform (equal blocks per stage), "
                        "or manual:N0,N1,... (blocks per stage)")
    g.add_argument("--split-cost", choices=("flops", "time"), default="flops",
                   help="what --split auto balances: FLOPs counted by FlopCounterMode, or forward+backward time "
                        "measured per layer on this device")
    g.add_argument("--bind-cores", choices=("none", "cost"), default="none",
                   help="CPU only: cost = pin each rank to one core, packing a node's ranks onto its cores by their "
                        "stages' estimated work (heaviest first), so a heavy stage is not time-shared with light ones "
                        "when ranks outnumber cores")
    g.add_argument("--compact-cpu-memory", action="store_true",
                   help="CPU only (glibc): take every tensor of 4 MiB or more straight from the kernel and give it "
                        "back when freed (mallopt M_MMAP_THRESHOLD), so a rank's resident memory follows its live "
                        "tensors instead of the heap's high-water mark; about 10-20%% slower steps (page faults); "
                        "for when memory, not speed, is the limit (by default CPU ranks keep freed memory for the next "
                        "micro-batch: runtime/device.py retain_cpu_heap)")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the planner's memory model predicts the node's RAM (CPU) or a GPU's memory "
                        "would overflow (by default such a run stops before building anything, naming flags that fit)")

    g = p.add_argument_group("precision and optimisation")
    g.add_argument("--precision", choices=tuple(PRECISIONS),
                   help="; ".join(f"{p.name} = {p.description}" for p in PRECISIONS.values()) + ". Default: bf16 "
                        "where the device computes it fast (CUDA compute capability >= 8.0, a CPU with AVX-512 BF16 "
                        "or AMX), else fp32")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps, then cosine decay to lr/10")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", choices=AC_MODES,
                   help="recompute in the backward pass to save activation memory: full (also the flag alone) keeps "
                        "only each transformer block's input; selective keeps its matrix products' and attention's "
                        "outputs and recomputes the rest (norms, activations, RoPE: little compute)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --mp > 1: run the norms and keep the residual stream on sequence shards (T/mp per "
                        "rank; Korthikanti et al. 2022), all-gathering before and reduce-scattering after each "
                        "tensor-parallel region instead of all-reducing")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (after TP and activation checkpointing, before FSDP); "
                        "not with the split-backward schedules (zero-bubble, zbv, dualpipev)")
    g.add_argument("--seed", type=int, default=1234, help="seed for weights and data order")
    g.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                   help="bound on every collective and point-to-point wait, the first step's included; past it the "
                        "ranks exit with one line naming the operation and peers (default: 300)")
    g.add_argument("--stop-at-step", type=int,
                   help="end this run after step N (saving a checkpoint if --checkpoint-dir is set), e.g. to fit a "
                        "job's time limit; the LR schedule still spans --steps and --resume continues")

    g = p.add_argument_group("checkpoints and recovery")
    g.add_argument("--checkpoint-dir", help="folder for checkpoints (torch.distributed.checkpoint, every rank writes "
                                            "its own shards); one is always saved at the end of the run")
    g.add_argument("--checkpoint-every", type=int, help="also save a checkpoint every N steps")
    g.add_argument("--keep-checkpoints", type=int, help="keep the newest K complete checkpoints (default: 3)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="copy the state to CPU memory and write it in the background while training goes on "
                        "(DCP async_save; published at the first step boundary after every rank's write is done)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir (from scratch if there is none)")
    g.add_argument("--resume-from", metavar="PATH", help="continue from this checkpoint folder, on any mesh")
    g.add_argument("--init-from", metavar="PATH",
                   help="start from these weights, on any mesh: a single-file export (`run.py export`), or a Hugging "
                        "Face model folder (config.json + safetensors or pytorch_model.bin; GPT-2 or Llama), whose "
                        "config.json sets the model: shape flags may be given only if they agree, --seq-len may be "
                        "shorter than the folder's positions. With --resume, a checkpoint (when there is one) gives "
                        "the weights instead")
    g.add_argument("--max-bad-steps", type=int, default=5,
                   help="stop after K consecutive steps with a non-finite loss or gradient norm (fp32/bf16), or "
                        "after more than K consecutive skipped steps (fp16)")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="fp16: stop when the loss scale falls below this floor")

    g = p.add_argument_group("data")
    g.add_argument("--data", default="builtin",
                   help="builtin (Python's bundled documentation text, byte-level), synthetic (seeded random "
                        "tokens), a UTF-8 .txt file or a folder of them (byte-level), a nanoGPT .bin of token ids "
                        "(--token-dtype), llm.c shards (a .bin file, a folder or a quoted glob; *_val_* shards "
                        "validate), a Megatron NAME.bin/NAME.idx pair (the prefix or either file), or a mixture "
                        "by token share: 0.7:PATH_A,0.3:PATH_B")
    g.add_argument("--val-data", metavar="PATH",
                   help="a validation set of its own, of any --data kind (default: llm.c *_val_* shards, nanoGPT "
                        "val.bin beside train.bin, else the last --val-fraction of the tokens)")
    g.add_argument("--data-format", choices=DATA_FORMATS, default="auto",
                   help="how to read --data and --val-data; auto decides by the name and the header (.txt text, "
                        ".bin token ids) and refuses to guess otherwise")
    g.add_argument("--token-dtype", choices=tuple(TOKEN_DTYPES), default="uint16",
                   help="the token ids' type in a headerless nanoGPT .bin (llm.c and Megatron files say theirs)")
    g.add_argument("--eod-token", type=int, metavar="ID",
                   help="the end-of-document token id (e.g. 50256, GPT-2's <|endoftext|>): positions within "
                        "documents restart after it")
    g.add_argument("--document-mask", action="store_true",
                   help="restart attention and positions at each document: needs --eod-token or a Megatron "
                        "document index")
    g.add_argument("--val-fraction", type=float, default=0.1, help="fraction of the tokens held out for validation")
    g.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps and at the end; 0 = no validation")
    g.add_argument("--eval-batches", type=int, default=2, help="global batches per validation")

    g = p.add_argument_group("metrics")
    g.add_argument("--logdir", help="TensorBoard folder (default: tensorboard_logs/<model>_dp<D>_pp<P>_mp<M>_"
                                    "<schedule>_<precision>_<timestamp>)")
    g.add_argument("--log-every", type=int, default=10, help="progress line and scalars every N steps")
    g.add_argument("--peak-tflops", type=float,
                   help="peak TFLOP/s per rank for MFU; default: the GPU's dense datasheet peak for the precision "
                        "(H100 SXM bf16: 989.4), measured for a GPU not in the table, and on the CPU a short "
                        "concurrent matmul calibration")
    g.add_argument("--profile", action="store_true",
                   help="time-split every rank's last 3 steps (compute, p2p, TP/DP collectives, optimizer, idle) "
                        "and write time_split.json, a Chrome trace timeline.json and a Gantt image to the logdir")
    g.add_argument("--profile-memory", action="store_true",
                   help="measure the peak tensor memory of the second step (on CPU from the allocator's events "
                        "in torch.profiler) as mem/peak_tensor_bytes and peak_tensor_bytes in summary.json")
    return p


def explicit_flags(argv: list[str]) -> set[str]:
    """The flags (e.g. "--dp") ``argv`` sets explicitly, whatever their values."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return {"--" + dest.replace("_", "-") for dest in vars(parser.parse_args(argv))}


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value}")


def build_config(args: argparse.Namespace, *, world_size: int | None = None, now: float | None = None) -> TrainConfig:
    """The config the flags describe; with ``world_size``, validated for that many processes (without, every
    check that needs no world size). Raises ConfigError."""
    for flag in ("dp", "pp", "mp", "dp_shard", "layers", "d_model", "heads", "kv_heads", "seq_len", "vocab_size", "mlp_width", "stages_per_rank",
                 "microbatches", "micro_batch_size", "global_batch_size", "steps", "lr", "log_every",
                 "eval_batches", "peak_tflops", "stop_at_step", "checkpoint_every", "keep_checkpoints",
                 "max_bad_steps", "min_loss_scale"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("warmup_steps", "weight_decay", "grad_clip", "eval_every"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.stop_at_step is not None and args.stop_at_step > args.steps:
        raise ConfigError(f"--stop-at-step {args.stop_at_step} must be at most --steps {args.steps}")

    mesh = MeshShape(args.dp, args.pp, args.mp)
    device = resolve_device_type(args.device)
    if world_size is not None:
        check_world(mesh, world_size)
    cfg = TrainConfig(
        model_name=args.model or (run_name(args.init_from) if _init_folder(args) else DEFAULT_MODEL),
        model=model_config(args),
        mesh=mesh,
        data_parallel=DataParallelConfig(args.dp_shard or args.dp, args.reshard_after_forward, args.reduce_dtype),
        pipeline=_pipeline_config(args, mesh),
        precision=args.precision or default_precision(fast_bf16=has_fast_bf16(device)),
        optim=OptimConfig(args.steps, args.lr, args.warmup_steps, args.weight_decay, args.grad_clip,
                          args.stop_at_step),
        data=DataConfig(args.data, args.val_fraction, args.eval_every, args.eval_batches, val_source=args.val_data,
                        token_dtype=args.token_dtype, data_format=args.data_format, eod_token=args.eod_token,
                        document_mask=args.document_mask),
        metrics=MetricsConfig(args.logdir or "", args.log_every, args.peak_tflops, args.profile, args.profile_memory),
        seed=args.seed,
        activation_checkpointing=args.activation_checkpointing,
        checkpoint=_checkpoint_config(args),
        guard=GuardConfig(args.max_bad_steps, args.min_loss_scale),
        compile_blocks=args.compile,
        sequence_parallel=args.sequence_parallel,
        collective_timeout_s=args.collective_timeout,
        device=device,
    )
    vocab_size = cfg.model.vocab_size
    if args.eod_token is not None and not 0 <= args.eod_token < vocab_size:
        raise ConfigError(f"--eod-token {args.eod_token} must be a token id in [0, {vocab_size}) (--vocab-size {vocab_size})")
    if world_size is not None:
        validate(cfg, world_size=world_size)
    return cfg if args.logdir else with_default_logdir(cfg, now=now)


def with_default_logdir(cfg: TrainConfig, *, now: float | None = None) -> TrainConfig:
    timestamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    m = cfg.mesh
    logdir = (f"tensorboard_logs/{cfg.model_name}_dp{m.dp}_pp{m.pp}_mp{m.mp}_{cfg.pipeline.schedule}_"
              f"{cfg.precision}_{timestamp}")
    return dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, logdir=logdir))


def config_from_args(args: argparse.Namespace, *, world_size: int, now: float | None = None) -> TrainConfig:
    """Build and validate the config. Raises ConfigError with a one-line message on bad input."""
    return build_config(args, world_size=world_size, now=now)


def parse_train_config(argv: list[str], *, world_size: int) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv), world_size=world_size)


def model_config(args: argparse.Namespace):
    """The ``--model`` size with the shape flags' overrides (the family's rules fill in the rest); with
    ``--init-from FOLDER``, the folder's model, the flags checked against it (runtime/checkpoint/hf_weights.py)."""
    overrides = dict(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads,
                     seq_len=args.seq_len, vocab_size=args.vocab_size, mlp_width=args.mlp_width)
    if _init_folder(args):
        return run_model_config(read_hf_model(args.init_from), model_name=args.model, overrides=overrides,
                                untie=args.untie_embeddings)
    try:
        return named_config(args.model or DEFAULT_MODEL, **overrides,
                            tie_embeddings=False if args.untie_embeddings else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _init_folder(args: argparse.Namespace) -> bool:
    """--init-from names a folder (a Hugging Face model), not a single-file export."""
    return bool(args.init_from) and Path(args.init_from).is_dir()


def default_config(model) -> TrainConfig:
    """A run of ``model`` with every other setting at its default: what plans are applied to."""
    return dataclasses.replace(build_config(build_parser().parse_args([]), now=0), model=model, model_name="custom")


def named_model(name: str, seq_len: int | None = None):
    return named_config(name, seq_len=seq_len)


# Config fields the shape flags set; everything else comes from the --model size.
_SHAPE_FLAGS = {"n_layers": "--layers", "d_model": "--d-model", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
                "seq_len": "--seq-len", "vocab_size": "--vocab-size", "mlp_width": "--mlp-width"}


def model_flags(cfg) -> list[str]:
    """Flags that make run.py build exactly ``cfg`` (for launching a run of it): a size of its family whose
    other fields (norms, RoPE, ...) it shares, and every shape flag."""
    spec = spec_of(cfg)
    for name, base in spec.sizes.items():
        flags = ["--model", name]
        for field, flag in _SHAPE_FLAGS.items():
            grouped = cfg.n_kv_heads != cfg.n_heads or base.n_kv_heads != base.n_heads
            if field != "n_kv_heads" or grouped:
                flags += [flag, str(getattr(cfg, field))]
        flags += [] if cfg.tie_embeddings else ["--untie-embeddings"]
        if model_config(build_parser().parse_args(flags)) == cfg:
            return flags
    raise ValueError(f"no --model size of the {spec.family} family plus shape flags builds {cfg}")


def _checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """Flag combinations only; whether the folders and files are usable is checked in runtime/checkpoint/files.py."""
    if args.checkpoint_dir is None:
        for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--keep-checkpoints", args.keep_checkpoints),
                            ("--resume", args.resume or None), ("--async-checkpoint", args.async_checkpoint or None)):
            if value is not None:
                raise ConfigError(f"{flag} needs --checkpoint-dir DIR (where checkpoints are saved)")
    if args.resume and args.resume_from:
        raise ConfigError("--resume and --resume-from are mutually exclusive: continue from one checkpoint")
    # --init-from may come with either: a checkpoint, when there is one, gives the weights (a folder still gives
    # the model), so one command line serves the first start and every restart.
    return CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep_checkpoints or 3,
                            resume=args.resume, resume_from=args.resume_from, init_from=args.init_from,
                            async_write=args.async_checkpoint)


def _pipeline_config(args: argparse.Namespace, mesh: MeshShape) -> PipelineConfig:
    v = args.stages_per_rank or default_stages_per_rank(args.schedule, mesh.pp)
    mbs, m, gbs = args.micro_batch_size, args.microbatches, args.global_batch_size
    if m is None and gbs is not None:
        if gbs % (mbs * mesh.dp):
            raise ConfigError(
                f"--global-batch-size {gbs} must be a multiple of --micro-batch-size {mbs} x --dp {mesh.dp} "
                f"= {mbs * mesh.dp}"
            )
        m = gbs // (mbs * mesh.dp)
    elif m is None:
        m = 2 * mesh.pp
    if gbs is not None and gbs != mbs * m * mesh.dp:
        raise ConfigError(
            f"--global-batch-size {gbs} must equal --micro-batch-size {mbs} x --microbatches {m} x --dp "
            f"{mesh.dp} = {mbs * m * mesh.dp}"
        )
    return PipelineConfig(args.schedule, v, m, mbs, args.split, args.split_cost, args.bind_cores,
                          args.compact_cpu_memory)
