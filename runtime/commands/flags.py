"""Command-line flags -> TrainConfig, in exactly one place. Flags exist only at the process boundary:
inside, everything passes the typed config (runtime/config.py) and plan objects. The flags themselves are
declared in groups in runtime/commands/flag_groups.py; ``build_config`` reads every training flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from compiler.lora import LoraConfig, default_targets
from compiler.parallel_plan import ParallelPlan
from compiler.precisions import default_precision
from models import mixture_of_experts_families, named_config, spec_of
from runtime.checkpoint.hf_weights import read_hf_model, run_model_config, run_name
from runtime.checkpoint.peft import read_adapter
from runtime.checkpoint.safetensors import TensorFileError
from runtime.commands.flag_groups import (  # noqa: F401 (re-exported: the commands' parsers)
    DEFAULT_MODEL,
    HelpFormatter,
    build_parser,
    command_parser,
    with_training_defaults,
)
from runtime.commands.flag_table import AUTO_CHOSEN_FIELDS, FLAG_OF
from runtime.config import (
    SHAPE_FLAGS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GuardConfig,
    MetricsConfig,
    OptimConfig,
    PlacementConfig,
    TrainConfig,
    check_world,
    default_stages_per_rank,
    validate,
)
from runtime.device import has_fast_bf16, resolve_device_type
from runtime.engine.data import DataError, parse_mixture
from runtime.engine.data.detect import is_chat_data
from runtime.tokenizer import has_tokenizer

# The flags --auto chooses (the planner's plan): giving one with --auto is an error.
AUTO_CHOSEN = tuple(FLAG_OF[f] for f in AUTO_CHOSEN_FIELDS)


def explicit_flags(argv: list[str]) -> set[str]:
    """The flags (e.g. "--dp") ``argv`` sets explicitly, whatever their values."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    return {flags[dest] for dest in vars(parser.parse_args(argv))}


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value}")


def build_config(args: argparse.Namespace, *, world_size: int | None = None, now: float | None = None) -> TrainConfig:
    """The config the flags describe; with ``world_size``, validated for that many processes (without, every
    check that needs no world size). Raises ConfigError."""
    for flag in ("dp", "pp", "mp", "dp_shard", "layers", "d_model", "heads", "kv_heads", "seq_len", "vocab_size",
                 "mlp_width", "stages_per_rank",
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

    device = resolve_device_type(args.device)
    plan = plan_from_args(args, precision=args.precision or default_precision(fast_bf16=has_fast_bf16(device)))
    if world_size is not None:
        check_world(plan, world_size)
    cfg = TrainConfig(
        model_name=args.model or (run_name(args.init_from) if _init_folder(args) else DEFAULT_MODEL),
        model=model_config(args),
        plan=plan,
        placement=PlacementConfig(args.split_cost, args.bind_cores, args.compact_cpu_memory),
        optim=OptimConfig(args.steps, args.lr, args.warmup_steps, args.weight_decay, args.grad_clip,
                          args.stop_at_step),
        data=_data_config(args),
        metrics=MetricsConfig(args.logdir or "", args.log_every, args.peak_tflops, args.profile, args.profile_memory),
        seed=args.seed,
        checkpoint=_checkpoint_config(args),
        guard=GuardConfig(args.max_bad_steps, args.min_loss_scale),
        compile_blocks=args.compile,
        collective_timeout_s=args.collective_timeout,
        startup_timeout_s=args.startup_timeout,
        checkpoint_timeout_s=args.checkpoint_timeout,
        device=device,
        expert_bias_rate=getattr(args, "expert_bias_rate", 0.0),
        mtp_loss_weight=getattr(args, "mtp_loss_weight", 0.3),
    )
    cfg = _fine_tuning_without_mtp(dataclasses.replace(cfg, lora=lora_config(args, cfg.model)),
                                   asked=getattr(args, "mtp_depth", None))
    if not cfg.mtp_loss_weight >= 0:
        raise ConfigError(f"--mtp-loss-weight must be >= 0, got {cfg.mtp_loss_weight}")
    vocab_size = cfg.model.vocab_size
    if args.eod_token is not None and not 0 <= args.eod_token < vocab_size:
        raise ConfigError(f"--eod-token {args.eod_token} must be a token id in [0, {vocab_size}) (--vocab-size {vocab_size})")
    if cfg.data.no_loss_across_documents and args.eod_token is None:
        raise ConfigError("--no-loss-across-documents needs --eod-token ID: the token that ends each document")
    if world_size is not None:
        validate(cfg, world_size=world_size)
    return cfg if args.logdir else with_default_logdir(cfg, now=now)


_LORA_SETTINGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets", "dropout": "--lora-dropout"}


def lora_config(args: argparse.Namespace, model) -> LoraConfig | None:
    """The ``--lora-*`` flags (``--lora-from``: a peft folder's settings, which flags given must agree with); None
    without ``--lora-rank`` or ``--lora-from``. Checked against the model in ``validate`` (runtime/config.py)."""
    given = {field: getattr(args, f"lora_{field}", None) for field in _LORA_SETTINGS}
    if given["targets"] is not None:  # given empty ("" or ","): no target, which validate refuses naming the valid ones
        given["targets"] = tuple(dict.fromkeys(t.strip() for t in given["targets"].split(",") if t.strip()))
    source = getattr(args, "lora_from", None)
    if source is None and given["rank"] is None:
        extra = [_LORA_SETTINGS[f] for f, v in given.items() if v is not None]
        extra += ["--lora-base-dtype"] if getattr(args, "lora_base_dtype", "fp32") != "fp32" else []
        if extra:
            raise ConfigError(f"{extra[0]} needs --lora-rank R (or --lora-from FOLDER): no adapters are trained without")
        return None
    base_dtype = getattr(args, "lora_base_dtype", "fp32")
    if source is None:
        rank = given["rank"]
        return LoraConfig(rank=rank, alpha=given["alpha"] if given["alpha"] is not None else 2.0 * rank,
                          targets=default_targets(model) if given["targets"] is None else given["targets"],
                          dropout=given["dropout"] or 0.0, base_dtype=base_dtype)
    try:
        lora, _ = read_adapter(source, model)
    except (TensorFileError, ValueError) as e:
        raise ConfigError(f"--lora-from {source}: {e}") from None
    for field in ("rank", "alpha", "targets"):  # what the adapters are; dropout may change between runs
        value, saved = given[field], getattr(lora, field)
        if value is not None and (set(value) != set(saved) if field == "targets" else value != saved):
            shown = (",".join(value), ",".join(saved)) if field == "targets" else (f"{value:g}", f"{saved:g}")
            raise ConfigError(f"{_LORA_SETTINGS[field]} {shown[0]} differs from --lora-from {source}'s {shown[1]}; "
                              f"leave it out to use the folder's")
    return dataclasses.replace(lora, dropout=given["dropout"] if given["dropout"] is not None else lora.dropout,
                               base_dtype=base_dtype)


def with_default_logdir(cfg: TrainConfig, *, now: float | None = None) -> TrainConfig:
    timestamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    m = cfg.plan
    logdir = (f"tensorboard_logs/{cfg.model_name}_dp{m.dp}_pp{m.pp}_mp{m.mp}_{cfg.plan.schedule}_"
              f"{cfg.plan.precision}_{timestamp}")
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
        cfg = run_model_config(read_hf_model(args.init_from), model_name=args.model, overrides=overrides,
                               untie=args.untie_embeddings)
    else:
        try:
            cfg = named_config(args.model or DEFAULT_MODEL, **overrides,
                               tie_embeddings=False if args.untie_embeddings else None)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return _with_mtp_depth(_with_expert_bias(cfg, getattr(args, "expert_bias_rate", 0.0)), getattr(args, "mtp_depth", None))


def _with_mtp_depth(cfg, depth: int | None):
    """``--mtp-depth``: the model's multi-token-prediction depths (None: the folder's, or 0)."""
    if depth is None:
        return cfg
    if depth < 0:
        raise ConfigError(f"--mtp-depth must be >= 0 (0: no multi-token prediction), got {depth}")
    if not hasattr(cfg, "mtp_depth"):
        raise ConfigError(f"--mtp-depth {depth}: the {cfg.family} family does not build multi-token-prediction depths")
    if depth >= cfg.seq_len:  # depth k's label is t_{i+k+1} (future_tokens.py): none within T + 1 tokens for k >= T
        raise ConfigError(f"--mtp-depth {depth} with --seq-len {cfg.seq_len}: depth k predicts the token k + 1 ahead, and "
                          f"a window holds none for k >= {cfg.seq_len}; valid --mtp-depth values: 0 to {cfg.seq_len - 1}")
    return dataclasses.replace(cfg, mtp_depth=depth)


def _fine_tuning_without_mtp(cfg: TrainConfig, *, asked: int | None) -> TrainConfig:
    """Fine-tuning (LoRA, chat data) trains the next-token objective alone, as DeepSeek-V3's post-training does: a
    folder's multi-token-prediction depths are left out; asked for with ``--mtp-depth``, they are refused."""
    tuning = [flag for flag, on in (("--lora-rank", cfg.lora is not None), ("chat data", cfg.data.chat)) if on]
    if not tuning or not getattr(cfg.model, "mtp_depth", 0):
        return cfg
    if asked:
        raise fine_tuning_mtp_error(tuning, asked)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0))


def fine_tuning_mtp_error(tuning: list[str], asked: int) -> ConfigError:
    """``--mtp-depth`` asked of a fine-tuning run (``tuning``: its flags, e.g. ``--lora-rank``): train and plan refuse it."""
    return ConfigError(f"--mtp-depth {asked} with {' and '.join(tuning)}: fine-tuning trains without multi-token "
                       f"prediction; use --mtp-depth 0")


def _with_expert_bias(cfg, rate: float):
    """``--expert-bias-rate``: the model's routers get a selection-only bias (mixture-of-experts models only)."""
    if rate < 0:
        raise ConfigError(f"--expert-bias-rate must be >= 0, got {rate}")
    if rate == 0:
        return cfg
    if not hasattr(cfg, "expert_bias"):
        raise ConfigError(f"--expert-bias-rate {rate}: {cfg.family} has no mixture-of-experts routers to balance; "
                          f"drop it (mixture-of-experts families: {', '.join(mixture_of_experts_families())})")
    return dataclasses.replace(cfg, expert_bias=True)


def _data_config(args: argparse.Namespace) -> DataConfig:
    """The data flags. Chat data trains on assistant tokens, its conversations packed into windows under the
    document mask (or one per window with --no-packing)."""
    chat = _chat_data(args)
    packing = not getattr(args, "no_packing", False)
    long_conversations = getattr(args, "long_conversations", None)
    for flag, given in (("--long-conversations", long_conversations is not None), ("--no-packing", not packing)):
        if given and not chat:
            raise ConfigError(f"{flag} applies to chat data (JSON lines of conversations, or token files with loss "
                              f"masks); --data {args.data} is not")
    if chat and getattr(args, "no_loss_across_documents", False):
        raise ConfigError("--no-loss-across-documents: chat data already trains only on assistant tokens; drop it")
    return DataConfig(args.data, args.val_fraction, args.eval_every, args.eval_batches, val_source=args.val_data,
                      token_dtype=args.token_dtype, data_format=args.data_format, eod_token=args.eod_token,
                      document_mask=args.document_mask or (chat and packing), tokenizer=_tokenizer_folder(args),
                      no_loss_across_documents=getattr(args, "no_loss_across_documents", False), chat=chat,
                      long_conversations=long_conversations or "truncate", packing=packing)


def _chat_data(args: argparse.Namespace) -> bool:
    """Whether --data (and --val-data) are chat data; ConfigError where a mixture mixes it with plain tokens."""
    try:
        specs = [spec for flag, value in (("--data", args.data), ("--val-data", args.val_data)) if value
                 for _, spec in parse_mixture(value, flag=flag)]
    except DataError:
        return False  # the data's own checks name the mistake
    kinds = {spec: is_chat_data(spec, data_format=args.data_format) for spec in specs}
    kinds = {spec: is_chat for spec, is_chat in kinds.items() if is_chat is not None}  # the others' checks say why
    if len(set(kinds.values())) > 1:
        chat = ", ".join(spec for spec, is_chat in kinds.items() if is_chat)
        raise ConfigError(f"--data / --val-data mix chat data ({chat}: loss on assistant tokens) with plain tokens; "
                          f"train and validate on one kind")
    return any(kinds.values())


def _tokenizer_folder(args: argparse.Namespace) -> str | None:
    """--tokenizer, else the --init-from folder when it holds a tokenizer.json (validate checks --tokenizer)."""
    return args.tokenizer or (args.init_from if _init_folder(args) and has_tokenizer(args.init_from) else None)


def _init_folder(args: argparse.Namespace) -> bool:
    """--init-from names a folder (a Hugging Face model), not a single-file export."""
    return bool(args.init_from) and Path(args.init_from).is_dir()


def default_config(model) -> TrainConfig:
    """A run of ``model`` with every other setting at its default: what plans are applied to."""
    return dataclasses.replace(build_config(build_parser().parse_args([]), now=0), model=model, model_name="custom")


def named_model(name: str, seq_len: int | None = None):
    return named_config(name, seq_len=seq_len)


def model_flags(cfg) -> list[str]:
    """Flags that make run.py build exactly ``cfg`` (for launching a run of it): a size of its family whose
    other fields (norms, RoPE, ...) it shares, and every shape flag."""
    spec = spec_of(cfg)
    for name, base in spec.sizes.items():
        flags = ["--model", name]
        for field, flag in SHAPE_FLAGS.items():
            grouped = cfg.n_kv_heads != cfg.n_heads or base.n_kv_heads != base.n_heads
            if field != "n_kv_heads" or grouped:
                flags += [flag, str(getattr(cfg, field))]
        flags += [] if cfg.tie_embeddings else ["--untie-embeddings"]
        flags += ["--mtp-depth", str(cfg.mtp_depth)] if getattr(cfg, "mtp_depth", 0) else []
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


def plan_from_args(args: argparse.Namespace, *, precision: str) -> ParallelPlan:
    """The plan the layout flags give (flag_table.py): v defaults to the schedule's, the micro-batch count to
    global batch / (micro-batch size x dp), else 2 x pp."""
    v = args.stages_per_rank or default_stages_per_rank(args.schedule, args.pp)
    mbs, m, gbs = args.micro_batch_size, args.microbatches, args.global_batch_size
    if m is None and gbs is not None:
        if gbs % (mbs * args.dp):
            raise ConfigError(
                f"--global-batch-size {gbs} must be a multiple of --micro-batch-size {mbs} x --dp {args.dp} "
                f"= {mbs * args.dp}"
            )
        m = gbs // (mbs * args.dp)
    elif m is None:
        m = 2 * args.pp
    if gbs is not None and gbs != mbs * m * args.dp:
        raise ConfigError(
            f"--global-batch-size {gbs} must equal --micro-batch-size {mbs} x --microbatches {m} x --dp "
            f"{args.dp} = {mbs * m * args.dp}"
        )
    return ParallelPlan(dp=args.dp, pp=args.pp, mp=args.mp, cp=args.cp, ep=args.ep, schedule=args.schedule,
                        stages_per_rank=v, microbatches=m, micro_batch_size=mbs, precision=precision, ac=args.ac,
                        dp_shard=None if args.dp_shard in (None, args.dp) else args.dp_shard,
                        reshard_after_forward=args.reshard_after_forward, reduce_dtype=args.reduce_dtype,
                        sequence_parallel=args.sequence_parallel, split=args.split, fp8=args.fp8,
                        fp8_all_gather=args.fp8_all_gather, cp_gather=args.cp_gather)
