"""The command line's flags in groups, one ``add_*_flags(parser)`` function per concern (an argument group of
its own in ``--help``). Training's parser is every group (``TRAINING_FLAG_GROUPS``); a subcommand that runs
part of the engine builds its parser from the groups it uses (``run.py eval``: mesh, model, micro-batching,
precision, data), so its ``--help`` offers only flags it reads. A new flag goes into the group of its
concern; runtime/commands/flags.py turns the parsed flags into the typed config.
"""

from __future__ import annotations

import argparse
from typing import Callable

from models import FAMILIES, MODEL_NAMES
from runtime.commands.flag_table import add_plan_flags
from runtime.config import ConfigError
from runtime.device import DEVICE_CHOICES
from runtime.distributed.process_group import DEFAULT_COLLECTIVE_TIMEOUT_S
from runtime.distributed.timeouts import DEFAULT_CHECKPOINT_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S
from runtime.engine.data import DATA_FORMATS, TOKEN_DTYPES

DEFAULT_MODEL = "tiny"


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse would print a usage block and exit on every rank; raise instead, so that run.py prints
    one line on rank 0 and every rank exits with the same code."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except for flags whose absence means 'derived' (None) or 'off' (False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An empty parser that raises ConfigError (one line) on bad flags and shows defaults in --help."""
    return _OneLineErrorParser(prog=prog, description=description, formatter_class=HelpFormatter)


# ---- flag groups: each adds one concern's flags (an argument group of its own in --help) ----

def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mesh (dp x pp x cp x mp must equal the number of processes)")
    add_plan_flags(g, ("dp", "pp", "mp", "cp", "cp_gather", "ep"))
    g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where the ranks compute: cuda (one GPU per rank, NCCL), cpu (gloo, also on a GPU machine), "
                        "auto = the accelerator when there is one, else the CPU")


def add_data_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallelism")
    add_plan_flags(g, ("dp_shard", "reshard_after_forward", "reduce_dtype"))


def add_auto_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auto", action="store_true",
                   help="let the planner choose mesh, schedule, v, micro-batching, activation checkpointing (and "
                        "precision unless --precision is given) for this world size; see `run.py plan`")


def add_model_shape_flags(g: argparse._ActionsContainer) -> None:
    """The shape flags that override a named size's (train, eval, plan); the family's rules fill in the rest."""
    g.add_argument("--layers", type=int, help="transformer blocks (overrides the size's)")
    g.add_argument("--d-model", type=int, help="override the hidden width")
    g.add_argument("--heads", type=int, help="override the number of attention heads")
    g.add_argument("--kv-heads", type=int,
                   help="override the number of key/value heads (grouped-query attention; llama3 models)")
    g.add_argument("--seq-len", type=int,
                   help="tokens per training window (default: the model's). A model with weights (--init-from "
                        "FOLDER) keeps its context (GPT-2's n_positions and position table, Llama's "
                        "max_position_embeddings): the window must fit in it. A model built from scratch gets "
                        "this context (GPT-2: a position table of this many rows; Llama: at least this many)")
    g.add_argument("--vocab-size", type=int, help="override the vocabulary size (>= 256 for byte-level text)")
    g.add_argument("--mlp-width", type=int,
                   help="override the MLP hidden width (default: the family's rule, 4 x d-model for GPT-2, "
                        "Llama's SwiGLU rule)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(MODEL_NAMES), metavar="NAME",
                   help=f"named size of a model family (default: {DEFAULT_MODEL}; with --init-from FOLDER, the folder's "
                        "model): " + "; ".join(s.description for s in FAMILIES.values()))
    add_model_shape_flags(g)
    g.add_argument("--untie-embeddings", action="store_true",
                   help="give the LM head its own weight instead of reusing the token embedding (GPT-2 ties them)")
    g.add_argument("--expert-bias-rate", type=float, default=0.0, metavar="GAMMA",
                   help="mixture-of-experts models: auxiliary-loss-free load balancing (DeepSeek-V3): a selection-only "
                        "bias per expert, moved by GAMMA toward the mean load after every step (DeepSeek-V3: 0.001); "
                        "0: none")


def add_mtp_flags(p: argparse.ArgumentParser) -> None:
    """Multi-token prediction, a training objective (eval and generate build no depth)."""
    g = p.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-depth", type=int, metavar="D",
                   help="multi-token prediction (DeepSeek-V3 sec. 2.2), any family: D sequential modules (the family's "
                        "block, a 2d -> d projection, norms; embedding and head shared) predict the tokens 2..D+1 "
                        "ahead, trained beside the model on the last pipeline stage (default: the --init-from folder's "
                        "num_nextn_predict_layers, else 0; generate and eval ignore them)")
    g.add_argument("--mtp-loss-weight", type=float, default=0.3, metavar="W",
                   help="with --mtp-depth: the loss is the next-token loss + W x the depths' mean loss (DeepSeek-V3: "
                        "0.3, then 0.1)")


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline and batch")
    add_plan_flags(g, ("schedule", "stages_per_rank", "microbatches", "micro_batch_size"))
    g.add_argument("--global-batch-size", type=int,
                   help="samples per optimizer step over all replicas; must equal micro-batch size x microbatches x dp")
    add_plan_flags(g, ("split",))


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation memory and sequence parallelism")
    add_plan_flags(g, ("ac", "sequence_parallel"))


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement and memory")
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
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (after TP and activation checkpointing, before FSDP); "
                        "not with the split-backward schedules (zero-bubble, zbv, dualpipev)")


def add_precision_flag(p: argparse.ArgumentParser) -> None:
    add_plan_flags(p, ("precision", "fp8", "fp8_all_gather"))


def add_optim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps, then cosine decay to lr/10")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    g.add_argument("--stop-at-step", type=int,
                   help="end this run after step N (saving a checkpoint if --checkpoint-dir is set), e.g. to fit a "
                        "job's time limit; the LR schedule still spans --steps and --resume continues")
    g.add_argument("--max-bad-steps", type=int, default=5,
                   help="stop after K consecutive steps with a non-finite loss or gradient norm (fp32/bf16), or "
                        "after more than K consecutive skipped steps (fp16); a skipped step moves neither the weights nor "
                        "the LR schedule")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="fp16: stop when the loss scale falls below this floor")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA fine-tuning (Hu et al. 2021): the model frozen, low-rank adapters trained")
    g.add_argument("--lora-rank", type=int, metavar="R",
                   help="train rank-R adapters W + (alpha/R) B A on the --lora-targets, every other parameter frozen "
                        "(no gradient, no optimizer state)")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="the adapters' scale is A/R (default: 2 x R)")
    g.add_argument("--lora-targets", metavar="LIST",
                   help="comma-separated modules of each block to adapt, by the family's names: q,k,v,o,gate,up,down "
                        "(GPT-2: qkv,o,up,down; latent attention: q_a,q,kv_a,kv_b,o); experts = one adapter per routed "
                        "expert on its gate, up and down (default: every linear layer of the blocks, no experts)")
    g.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' inputs (default 0)")
    g.add_argument("--lora-base-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="storage of the frozen weights: fp32 (the training dtype) or bf16 (half the bytes; needs "
                        "--precision bf16)")
    g.add_argument("--lora-from", metavar="FOLDER",
                   help="start the adapters from a peft adapter folder (adapter_config.json + adapter_model.safetensors, "
                        "e.g. `run.py export --format peft`), whose rank, alpha, targets and dropout then apply")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("seed and timeouts")
    g.add_argument("--seed", type=int, default=1234, help="seed for weights and data order")
    g.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                   help="bound on every collective and point-to-point wait in steady steps (after the first); past "
                        "it the ranks exit with one line naming the phase, operation and peers")
    g.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, metavar="SECONDS",
                   help="that bound in start-up: process groups, tracing, --compile, the first step and first validation")
    g.add_argument("--checkpoint-timeout", type=float, default=DEFAULT_CHECKPOINT_TIMEOUT_S, metavar="SECONDS",
                   help="bound on waits for other ranks while saving or loading a checkpoint (a slow file system)")


def add_init_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init-from", metavar="PATH",
                   help="start from these weights, on any mesh: a single-file export (`run.py export`), or a Hugging "
                        "Face model folder (config.json + safetensors or pytorch_model.bin; GPT-2 or Llama), whose "
                        "config.json sets the model: shape flags may be given only if they agree, --seq-len may be "
                        "shorter than the folder's context (the model keeps all of it). With --resume, a checkpoint "
                        "(when there is one) gives the weights instead")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
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


def add_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default="builtin",
                   help="builtin (Python's bundled documentation text, byte-level), synthetic (seeded random "
                        "tokens), a UTF-8 .txt file or a folder of them (byte-level), chat JSON lines (.jsonl: "
                        "{\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...} per line, rendered with the "
                        "--tokenizer folder's chat template; the loss trains on assistant tokens), a nanoGPT .bin of token ids "
                        "(--token-dtype), llm.c shards (a .bin file, a folder or a quoted glob; *_val_* shards "
                        "validate), a Megatron NAME.bin/NAME.idx pair (the prefix or either file), or a mixture "
                        "by token share: 0.7:PATH_A,0.3:PATH_B")
    g.add_argument("--tokenizer", metavar="FOLDER",
                   help="a Hugging Face tokenizer folder (tokenizer.json): text --data (builtin, a .txt file or a folder "
                        "of them) is tokenized with it once per machine into the data cache, each file one document "
                        "ended by the tokenizer's eos; checkpoints keep a copy of it (default: the --init-from folder's, "
                        "when it has a tokenizer.json)")
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
    g.add_argument("--no-loss-across-documents", action="store_true",
                   help="no loss on the token after each --eod-token (the next document's first token is not "
                        "predicted from the previous one; Megatron's --eod-mask-loss); the loss stays a mean over "
                        "every position, a skipped one counting zero, so it is the same on any mesh")
    g.add_argument("--long-conversations", choices=("truncate", "drop"),
                   help="chat data: a conversation longer than --seq-len + 1 tokens is cut to its first --seq-len + 1 "
                        "(truncate, the default) or left out (drop); either is counted in the log")
    g.add_argument("--no-packing", action="store_true",
                   help="chat data: one conversation per window, padded (default: conversations packed into windows "
                        "by best fit, attention and positions restarting at each: the --document-mask machinery)")


def add_validation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--val-data", metavar="PATH",
                   help="a validation set of its own, of any --data kind (default: llm.c *_val_* shards, nanoGPT "
                        "val.bin beside train.bin, else the last --val-fraction of the tokens)")
    g.add_argument("--val-fraction", type=float, default=0.1, help="fraction of the tokens held out for validation")
    g.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps and at the end; 0 = no validation")
    g.add_argument("--eval-batches", type=int, default=2, help="global batches per validation")


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
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


FlagGroup = Callable[[argparse.ArgumentParser], None]

# Training reads every group; subcommands that build the engine name theirs (runtime/commands/eval.py).
TRAINING_FLAG_GROUPS: tuple[FlagGroup, ...] = (
    add_mesh_flags, add_data_parallel_flags, add_auto_flag, add_model_flags, add_mtp_flags, add_pipeline_flags,
    add_layout_flags, add_placement_flags,
    add_precision_flag, add_optim_flags, add_run_flags, add_init_flag, add_lora_flags, add_checkpoint_flags,
    add_data_flags,
    add_validation_flags, add_metrics_flags)


def build_parser(prog: str = "run.py") -> argparse.ArgumentParser:
    p = command_parser(
        prog, "Train a GPT on a (dp, pp, mp) mesh: traced pipeline stages, DTensor tensor "
        "parallelism, FSDP data parallelism, overlapped pipeline schedules and mixed precision. "
        "Launch with `torchrun --nproc_per_node=N run.py ...`; without torchrun it runs as one process. "
        "Subcommands: study, plan, calibrate, export, eval, generate, tokenize, data-benchmark (each has --help).")
    for add_flags in TRAINING_FLAG_GROUPS:
        add_flags(p)
    return p


def with_training_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of a subcommand's parser (a subset of training's groups) completed with training's defaults
    for the flags it does not offer, for ``build_config`` (runtime/commands/flags.py)."""
    defaults = vars(build_parser().parse_args([]))
    return argparse.Namespace(**{**defaults, **vars(args)})
