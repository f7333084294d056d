"""The run configuration: one frozen dataclass tree, and the checks that say whether the engine can run it.

Built from command-line flags in one place (runtime/commands/flags.py); a planner's plan is applied to
it as an object (``apply_plan``) and validated the same way. Each part of the program receives the
sub-config (or plain values) it needs, never the whole tree. Error messages name the flag a field
comes from, since that is what the user typed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from compiler.context_gather import cp_gather_problem
from compiler.fp8 import RECIPES
from compiler.lora import BASE_DTYPES, LoraConfig, target_problem
from compiler.parallel_plan import ParallelPlan, fp8_all_gather_problem
from compiler.parallelize.float8 import fp8_shard_problem
from compiler.partition import parse_split
from compiler.planner.candidates import meshes
from compiler.schedules import SCHEDULES, zero3_problem
from compiler.torch_compat import stages_receive_integer_tensors
from models import mixture_of_experts_families, spec_of
from models.spec import MOE, MP, listed_divisors
from runtime.distributed.process_group import DEFAULT_COLLECTIVE_TIMEOUT_S
from runtime.distributed.timeouts import DEFAULT_CHECKPOINT_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S, Timeouts
from runtime.tokenizer import has_tokenizer


class ConfigError(ValueError):
    """A flag value the engine cannot run with; the message names the flag and the valid values."""


@dataclass(frozen=True)
class PlacementConfig:
    """How this run's ranks use the machine, beyond the plan: what ``--split auto`` balances, CPU core binding and
    heap behaviour."""

    split_cost: str = "flops"  # what "auto" balances: "flops" (counted) or "time" (measured on the device)
    bind_cores: str = "none"  # CPU: "cost" packs a node's ranks onto its cores by stage work
    compact_cpu_memory: bool = False  # CPU (glibc): large tensors mapped from and returned to the kernel


@dataclass(frozen=True)
class OptimConfig:
    steps: int  # the LR schedule spans this many steps
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    stop_at_step: int | None = None  # end this run after that step (a later --resume continues)

    @property
    def last_step(self) -> int:
        return self.stop_at_step or self.steps


@dataclass(frozen=True)
class DataConfig:
    source: str  # "builtin" | "synthetic" | a path | a mixture "0.7:PATH,0.3:PATH"
    val_fraction: float
    eval_every: int  # 0: no validation
    eval_batches: int
    val_source: str | None = None  # --val-data: a validation set of its own
    token_dtype: str = "uint16"  # --token-dtype: what a headerless (nanoGPT) .bin holds
    data_format: str = "auto"  # --data-format: how to read --data / --val-data ("auto": by name and header)
    eod_token: int | None = None  # --eod-token: the end-of-document token id
    document_mask: bool = False  # --document-mask: attention and positions restart at each document
    # --no-loss-across-documents: no loss on the token that follows an end-of-document id (Megatron's eod_mask_loss)
    no_loss_across_documents: bool = False
    tokenizer: str | None = None  # --tokenizer (or the --init-from folder's): text is tokenized with it
    # Chat data (conversations, or token files with loss masks): the loss is a mean over the assistant tokens of
    # the global batch (runtime/engine/token_mean.py), conversations packed into windows
    chat: bool = False
    long_conversations: str = "truncate"  # --long-conversations: a conversation longer than a window is cut or left out
    packing: bool = True  # --no-packing clears it: one conversation per window, padded


@dataclass(frozen=True)
class MetricsConfig:
    logdir: str
    log_every: int
    peak_tflops: float | None
    profile: bool
    profile_memory: bool


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None  # where checkpoints are published; None = no checkpoints
    every: int | None  # also save every N steps (a checkpoint is always saved at the end)
    keep: int  # published checkpoints kept, newest first
    resume: bool  # continue from the latest complete checkpoint in ``dir``
    resume_from: str | None  # continue from this checkpoint folder
    init_from: str | None  # start from the weights of a single-file export
    async_write: bool = False  # --async-checkpoint: stage to CPU memory, write in the background


@dataclass(frozen=True)
class GuardConfig:
    max_bad_steps: int  # consecutive non-finite (fp32/bf16) or skipped (fp16) steps tolerated
    min_loss_scale: float  # fp16: a loss scale below this stops the run


@dataclass(frozen=True)
class TrainConfig:
    model_name: str
    model: Any  # the family's config dataclass (models/: cfg.family names the family)
    plan: ParallelPlan  # mesh, schedule, micro-batching, precision, AC, DP mode, SP, split (compiler/parallel_plan.py)
    optim: OptimConfig
    data: DataConfig
    metrics: MetricsConfig
    seed: int
    checkpoint: CheckpointConfig
    guard: GuardConfig
    placement: PlacementConfig = PlacementConfig()
    compile_blocks: bool = False  # --compile: torch.compile each transformer block
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # --collective-timeout: a wait's bound in steady steps
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # --startup-timeout: groups, tracing, compile, first step
    checkpoint_timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S  # --checkpoint-timeout: saving and loading
    device: str = "cpu"  # --device, resolved: "cpu" (gloo) or the accelerator's type ("cuda": NCCL)
    expert_bias_rate: float = 0.0  # --expert-bias-rate: gamma of the MoE selection-bias update (0: none)
    lora: LoraConfig | None = None  # --lora-*: train low-rank adapters on a frozen model (compiler/lora/)
    mtp_loss_weight: float = 0.3  # --mtp-loss-weight: the MTP depths' mean loss's weight (the model's mtp_depth: how many)

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(startup_s=self.startup_timeout_s, steady_s=self.collective_timeout_s,
                        checkpoint_s=self.checkpoint_timeout_s)

    def to_dict(self) -> dict:
        """The run's settings as JSON-ready values (summary.json, checkpoints; compiler/parallel_plan.py
        ``plan_of_run`` reads the plan back, and the separate mesh / pipeline fields of older runs)."""
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        return out


def default_stages_per_rank(schedule: str, pp: int) -> int:
    return SCHEDULES[schedule].default_v if pp > 1 else 1


def plan_error(cfg: TrainConfig, plan: ParallelPlan) -> str | None:
    """Why the engine would refuse to train ``cfg`` with ``plan``, or None if it would run it."""
    if not plan.chunked_loss:  # the engine's loss is always chunked (compiler/parallelize/cross_entropy.py)
        return ("the whole-logits loss (the engine's is chunked): the engine does not run this (the planner prices it "
                "for plans at scale)")
    try:
        validate(dataclasses.replace(cfg, plan=plan), world_size=plan.world)
    except ConfigError as e:
        return str(e)
    return None


def plan_checker(cfg: TrainConfig):
    """``plan_error`` for ``cfg``'s run: the planner's check of a plan (compiler/planner/auto.py)."""
    return lambda plan: plan_error(cfg, plan)


def validate(cfg: TrainConfig, *, world_size: int) -> None:
    """Raise ConfigError (one line naming the flag and the valid values) if the engine cannot run ``cfg``."""
    plan = cfg.plan
    check_world(plan, world_size)
    _check_model(cfg.model, plan.mp)
    _check_window(cfg.model)
    _check_sequence_parallel(plan.sequence_parallel, cfg.model.seq_len, plan.mp)
    _check_context_parallel(plan, cfg.model.seq_len)
    check_cp_gather(plan, cfg.model)
    _check_expert_parallel(plan, cfg.model)
    _check_data_parallel(plan)
    _check_pipeline(plan, cfg.model)
    _check_split_backward(plan.schedule, compile_blocks=cfg.compile_blocks, zero3=plan.reshard_after_forward)
    if cfg.lora is not None:
        check_lora(cfg.lora, cfg.model, precision=plan.precision)
    _check_fp8(plan, cfg.model, compile_blocks=cfg.compile_blocks, lora=cfg.lora is not None)
    if cfg.data.tokenizer is not None and not has_tokenizer(cfg.data.tokenizer):
        raise ConfigError(f"--tokenizer {cfg.data.tokenizer}: no tokenizer.json there (a Hugging Face tokenizer folder)")
    _check_document_positions(_positions_flag(cfg), plan.pp)
    for flag, seconds in (("--collective-timeout", cfg.collective_timeout_s), ("--startup-timeout", cfg.startup_timeout_s),
                          ("--checkpoint-timeout", cfg.checkpoint_timeout_s)):
        if not seconds > 0:
            raise ConfigError(f"{flag} must be a positive number of seconds, got {seconds:g}")


def check_lora(lora: LoraConfig, model: Any, *, precision: str | None) -> None:
    """LoRA's flags against the model (targets it has) and the precision (a bf16 base computes in bf16; None: the
    planner's, searched)."""
    if lora.rank < 1:
        raise ConfigError(f"--lora-rank must be a positive number of dimensions, got {lora.rank}")
    if not lora.alpha > 0:
        raise ConfigError(f"--lora-alpha must be positive, got {lora.alpha:g}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {lora.dropout:g}")
    problem = target_problem(lora.targets, model)
    if problem:
        raise ConfigError(f"--lora-targets {','.join(lora.targets) or repr('')}: {problem}")
    if lora.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"--lora-base-dtype {lora.base_dtype}: valid values: {', '.join(BASE_DTYPES)}")
    if lora.base_dtype == "bf16" and precision not in (None, "bf16"):
        raise ConfigError(f"--lora-base-dtype bf16 stores the frozen weights in bf16 and needs --precision bf16 "
                          f"(matrix products in bf16), got --precision {precision}")


def _check_split_backward(schedule: str, *, compile_blocks: bool, zero3: bool) -> None:
    """No compiled stage and no ZeRO-3 under a split backward (compiler/schedules.py ``zero3_problem``)."""
    if not SCHEDULES[schedule].split_backward:
        return
    plain = ", ".join(n for n, s in SCHEDULES.items() if not s.split_backward)
    if compile_blocks:
        raise ConfigError(f"--compile cannot run with --schedule {schedule}: torch's split-backward schedules do not "
                          f"support compiled stages yet; use --schedule {plain}")
    if problem := zero3_problem(schedule, reshard_after_forward=zero3):
        raise ConfigError(problem)


def _positions_flag(cfg: TrainConfig) -> str | None:
    """What gives the blocks positions of their own, as messages name it (None: nothing does)."""
    if cfg.data.chat and cfg.data.packing:
        return "packed chat data (--no-packing gives each conversation a window of its own)"
    if cfg.data.document_mask:
        return "--document-mask"
    return f"--cp {cfg.plan.cp}" if cfg.plan.cp > 1 else None
def _check_fp8(plan: ParallelPlan, model: Any, *, compile_blocks: bool, lora: bool) -> None:
    """--fp8 runs one of compiler/fp8's recipes on any mesh whose shards hold whole scaling blocks; --fp8 any is
    the planner's to resolve."""
    check_fp8_all_gather(plan)
    if plan.fp8 is not None and plan.fp8 not in RECIPES:
        raise ConfigError(f"--fp8 {plan.fp8} lets the planner choose a recipe: give it with --auto; else --fp8 "
                          f"{', '.join(RECIPES)}")
    if plan.fp8 is None:
        return
    if lora:
        raise ConfigError(f"--fp8 {plan.fp8} with --lora-rank: LoRA's adapters have no FP8 path yet; drop one of them")
    if compile_blocks:
        raise ConfigError(f"--fp8 {plan.fp8} cannot run with --compile: its scales' reductions over ranks and its "
                          f"kernel probes run eagerly; drop --compile")
    problem = fp8_shard_problem(model, RECIPES[plan.fp8], mp=plan.mp, cp=plan.cp,
                                sequence_parallel=plan.sequence_parallel)
    if problem:
        raise ConfigError(f"--fp8 {plan.fp8} on this mesh: {problem}; use --fp8 tensorwise or rowwise (scales reduced "
                          f"over any shards) or another --mp / --cp")


def check_fp8_all_gather(plan: ParallelPlan) -> None:
    """--fp8-all-gather: tensorwise FP8 and sharded data parallelism (compiler/parallel_plan.py's rule); ``run.py
    plan`` checks the layout its flags fix with it too."""
    problem = fp8_all_gather_problem(plan)
    if problem:
        raise ConfigError(problem)


def _check_document_positions(flag: str | None, pp: int) -> None:
    """Packed documents (--document-mask) and context parallelism (--cp) give every block positions that travel
    between stages with the activations; ``flag`` names the one given (None: neither)."""
    if flag and pp > 1 and not stages_receive_integer_tensors():
        raise ConfigError(f"{flag} with --pp {pp} needs torch 2.13 or later: the positions travel between "
                          f"pipeline stages as integers, and this torch ({torch.__version__}) marks every tensor a stage "
                          f"receives as requiring gradients, which integers cannot; use --pp 1 or upgrade torch")


def check_world(mesh: ParallelPlan, world_size: int) -> None:
    if mesh.world != world_size:
        cp = f" x --cp {mesh.cp}" if mesh.cp > 1 else ""
        product = (f"--dp {mesh.dp} x --pp {mesh.pp}{cp} x --mp {mesh.mp} = {mesh.world} must equal the number "
                   f"of processes (WORLD_SIZE={world_size})")
        if world_size % mesh.cp:  # no dp x pp x mp completes it: the meshes of world / cp would be another world's
            raise ConfigError(f"{product}, and --cp {mesh.cp} does not divide {world_size}; valid --cp values: "
                              f"{listed_divisors(world_size)}")
        raise ConfigError(f"{product}; valid meshes: {', '.join(valid_meshes(world_size // mesh.cp))}"
                          + (f" (times --cp {mesh.cp})" if mesh.cp > 1 else ""))


def valid_meshes(world_size: int) -> list[str]:
    return [f"{dp}x{pp}x{mp}" for dp, pp, mp in meshes(world_size)]


# The flag that sets each model config field (what the user typed), for messages.
SHAPE_FLAGS = {"n_layers": "--layers", "d_model": "--d-model", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
               "seq_len": "--seq-len", "vocab_size": "--vocab-size", "mlp_width": "--mlp-width"}


def _check_model(model: Any, mp: int) -> None:
    """The model family's own checks (heads, kv heads, widths against --mp): its problem, stated in config fields,
    as one line naming the flags; a field no flag sets (top_k, a size's head_dim) is the --model size's."""
    problem = spec_of(model).check(model, mp)
    if problem:
        flags = {**SHAPE_FLAGS, MP: "--mp"}
        line = problem.message(lambda field: flags.get(field, field))
        raise ConfigError(line if all(f in flags for f in problem.fields) else f"--model: {line}")


def _check_window(model: Any) -> None:
    """The training window fits the model's context (positions beyond it have no embedding, or no RoPE the
    model was trained for)."""
    if model.seq_len > model.context:
        raise ConfigError(f"--seq-len {model.seq_len} is longer than the model's context of {model.context} "
                          f"positions; valid --seq-len values: 1 to {model.context}")


def _check_sequence_parallel(enabled: bool, seq_len: int, mp: int) -> None:
    if not enabled:
        return
    if mp == 1:
        raise ConfigError("--sequence-parallel splits the tensor-parallel ranks' activations over the sequence and "
                          "needs --mp > 1, got --mp 1")
    if seq_len % mp:
        raise ConfigError(f"--sequence-parallel needs --mp {mp} to divide --seq-len {seq_len}; "
                          f"valid --seq-len values: multiples of {mp}")


def _check_context_parallel(mesh: ParallelPlan, seq_len: int) -> None:
    """Each sequence is cut into 2 cp load-balanced chunks (compiler/parallelize/context_parallel.py); under SP a
    rank's T/cp tokens are split over mp again."""
    if mesh.cp < 1:
        raise ConfigError(f"--cp must be at least 1, got {mesh.cp}")
    if mesh.cp > 1 and seq_len % (2 * mesh.cp):
        raise ConfigError(f"--cp {mesh.cp} cuts each sequence into {2 * mesh.cp} chunks: --seq-len {seq_len} must be a "
                          f"multiple of {2 * mesh.cp}")
    if mesh.cp > 1 and mesh.sequence_parallel and (seq_len // mesh.cp) % mesh.mp:
        raise ConfigError(f"--sequence-parallel with --cp {mesh.cp} splits a rank's {seq_len // mesh.cp} tokens over "
                          f"--mp {mesh.mp}: --seq-len must be a multiple of {2 * mesh.cp * mesh.mp // math.gcd(2, mesh.mp)}")


def check_cp_gather(plan: ParallelPlan, model: Any) -> None:
    """--cp-gather latent: the model has latent attention and the run no FP8 (compiler/context_gather.py's rule)."""
    problem = cp_gather_problem(plan.cp_gather, latent_attention=spec_of(model).latent_attention(model) is not None,
                                fp8=plan.fp8 is not None)
    if problem:
        raise ConfigError(problem)


def _check_expert_parallel(mesh: ParallelPlan, model: Any) -> None:
    if mesh.ep < 1:
        raise ConfigError(f"--ep must be at least 1, got {mesh.ep}")
    if mesh.ep == 1:
        return
    if MOE not in spec_of(model).block_kinds(model):
        raise ConfigError(f"--ep {mesh.ep}: {model.family} has no mixture-of-experts layers to split over expert-parallel "
                          f"ranks; drop --ep (expert parallelism needs a mixture-of-experts model: "
                          f"{', '.join(mixture_of_experts_families())})")
    if mesh.dp % mesh.ep:
        raise ConfigError(f"--ep {mesh.ep} borrows its ranks from data parallelism and must divide --dp {mesh.dp}; "
                          f"valid --ep values: {listed_divisors(mesh.dp)}")
    if model.n_experts % mesh.ep:
        raise ConfigError(f"--ep {mesh.ep} must divide the model's {model.n_experts} experts; valid --ep values: "
                          f"{listed_divisors(mesh.dp, model.n_experts)}")


def _check_data_parallel(plan: ParallelPlan) -> None:
    mesh = dp = plan
    if mesh.dp % dp.shard:
        raise ConfigError(f"--dp-shard {dp.shard} must divide --dp {mesh.dp}; valid --dp-shard values: "
                          f"{listed_divisors(mesh.dp)} ({mesh.dp}: FSDP, 1: replicate, between: HSDP)")
    if mesh.dp * mesh.cp == 1 and (dp.reshard_after_forward or dp.reduce_dtype != "fp32"):
        flag = "--reshard-after-forward" if dp.reshard_after_forward else f"--reduce-dtype {dp.reduce_dtype}"
        raise ConfigError(f"{flag} needs --dp > 1 or --cp > 1: it changes how data-parallel ranks share parameters "
                          f"and gradients, and --dp and --cp are 1")
    if dp.reshard_after_forward and dp.shard == 1 and mesh.dp > 1:
        raise ConfigError("--reshard-after-forward needs sharded parameters: with --dp-shard 1 every rank holds "
                          "them whole; use --dp-shard > 1")


def _check_pipeline(plan: ParallelPlan, model: Any) -> None:
    v, m, pp, name = plan.stages_per_rank, plan.microbatches, plan.pp, plan.schedule
    spec = SCHEDULES[name]
    if spec.placement == "v" and pp < 2:
        raise ConfigError(f"--schedule {name} places two stages per rank in a V (rank r: stages r and 2p-1-r) "
                          f"and needs --pp >= 2, got --pp {pp}")
    if spec.fixed_v is not None and v != spec.fixed_v:
        others = ", ".join(n for n, s in SCHEDULES.items() if s.fixed_v is None)
        raise ConfigError(f"--schedule {name} runs {'one stage' if spec.fixed_v == 1 else f'{spec.fixed_v} stages'} "
                          f"per rank; --stages-per-rank must be {spec.fixed_v}, got {v} (use {others} for other v)")
    if pp == 1 and v != 1:
        raise ConfigError(f"--stages-per-rank must be 1 when --pp is 1, got {v}")
    n_stages = pp * v
    if model.n_layers < n_stages:
        raise ConfigError(
            f"--layers {model.n_layers} is too few for --pp {pp} x --stages-per-rank {v} = {n_stages} stages; "
            f"need at least {n_stages} layers (or lower --pp / --stages-per-rank)"
        )
    least = spec.min_microbatches_per_pp * pp
    if m < least:
        raise ConfigError(f"--microbatches {m} is too few for --schedule {name} with --pp {pp}; need >= {least}")
    if spec.microbatches_multiple_of_pp and m % pp:
        raise ConfigError(f"--microbatches {m} must be a multiple of --pp {pp} for --schedule {name}; "
                          f"valid values: {pp}, {2 * pp}, {3 * pp}, ...")
    try:
        parse_split(plan.split, n_stages=n_stages, n_layers=model.n_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
