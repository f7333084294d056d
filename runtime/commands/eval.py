"""``python run.py eval``: the loss and perplexity of a checkpoint (or an export) over a whole validation set.

    python run.py eval --checkpoint ckpt --data fineweb10B/                     # its *_val_* shards
    python run.py eval --init-from model.pt --model small --data val.bin        # an export: give its model flags
    python run.py eval --checkpoint ckpt --data held_out.txt                    # text, with the checkpoint's tokenizer
    torchrun --nproc_per_node=8 run.py eval --checkpoint ckpt --data val.bin --dp 2 --pp 2 --mp 2

    python run.py eval --init-from ~/models/Qwen3-0.6B --data val.bin          # a Hugging Face folder, any family

Every window of the data set is evaluated once (the format's validation split when it names one:
llm.c ``*_val_*`` shards, nanoGPT ``val.bin``; else every file), forward only, through the engine training
builds (runtime/engine/build.py), on any mesh; the result is one JSON line: loss, perplexity, bits per byte
for byte-level text, tokens and windows (chat data: the loss over the assistant tokens, counted in tokens). The
flags are training's groups that evaluation reads (mesh, DP mode, model, micro-batching, placement (SP, AC),
precision, data; runtime/commands/flag_groups.py), so a training command's layout evaluates its checkpoint;
nothing of optimisation, checkpointing or metrics. ``--precision`` defaults to fp32 here. Weights come as
training reads them (runtime/checkpoint/weights.py): a checkpoint (which brings its own model shape; ``--seq-len``
evaluates it on windows of another length, up to the model's context), a single-file export, or a Hugging Face
folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from compiler.lora import LoraConfig
from models import config_from_dict, with_window, without_mtp
from runtime.checkpoint.files import CheckpointError, CheckpointInfo
from runtime.checkpoint.state import load_model_only
from runtime.checkpoint.weights import check_init_from, initial_values, resolve_checkpoint
from runtime.commands import flag_groups as groups
from runtime.commands.flags import config_from_args
from runtime.config import ConfigError, TrainConfig, validate
from runtime.device import configure_cpu_threads, configure_fp32_matmuls, select_device
from runtime.distributed.process_group import LaunchEnv, collective_timeout, init_distributed, shutdown_distributed
from runtime.engine.build import build_engine
from runtime.engine.data import DataError, evaluation_corpus
from runtime.engine.data.build import packing_options
from runtime.engine.data.corpus import Corpus
from runtime.engine.data.packed import PackedCorpus
from runtime.engine.evaluation import Evaluation, evaluate_windows, summed_cross_entropy
from runtime.tokenizer import has_tokenizer

InputError = (ConfigError, DataError, CheckpointError)


# Training's flag groups that evaluation reads (forward only: no optimiser, checkpoint writing or metrics).
EVAL_FLAG_GROUPS = (groups.add_mesh_flags, groups.add_data_parallel_flags, groups.add_model_flags,
                    groups.add_pipeline_flags, groups.add_layout_flags, groups.add_precision_flag,
                    groups.add_run_flags, groups.add_init_flag, groups.add_lora_flags, groups.add_data_flags)


def build_parser() -> argparse.ArgumentParser:
    p = groups.command_parser("run.py eval", "Evaluate a checkpoint or an export over every window of a validation "
                              "set: one JSON line with loss, perplexity and tokens, on any mesh.")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a checkpoint folder (DIR/step-N) or a checkpoint directory (its latest complete checkpoint)")
    for add_flags in EVAL_FLAG_GROUPS:
        add_flags(p)
    p.set_defaults(precision="fp32")
    return p


@dataclasses.dataclass(frozen=True)
class EvalInputs:
    cfg: TrainConfig
    corpus: Corpus | PackedCorpus
    byte_level: bool
    description: str
    checkpoint: CheckpointInfo | None  # else the weights come from --init-from


def check_inputs(argv: list[str], env: LaunchEnv) -> EvalInputs:
    """Every input checked on every rank before any process group (one-line errors, as training's)."""
    args = build_parser().parse_args(argv)
    if (args.checkpoint is None) == (args.init_from is None):
        raise ConfigError("run.py eval needs exactly one of --checkpoint DIR and --init-from FILE")
    cfg = config_from_args(groups.with_training_defaults(args), world_size=env.world_size)
    cfg = dataclasses.replace(cfg, model=without_mtp(cfg.model))  # the next-token loss: no MTP depth is built
    checkpoint = None
    if args.checkpoint:
        checkpoint = resolve_checkpoint(Path(args.checkpoint))
        model = without_mtp(config_from_dict(checkpoint.config["model"]))  # its shape, at --seq-len if given
        try:
            model = with_window(model, args.seq_len) if args.seq_len else model
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # A LoRA run's checkpoint brings its adapters (its base in the dtype it was saved in: the load converts).
        lora = LoraConfig.from_dict(checkpoint.config.get("lora"))
        cfg = dataclasses.replace(cfg, model=model, lora=lora and dataclasses.replace(lora, base_dtype="fp32",
                                                                                       init_from=None))
        if cfg.data.tokenizer is None and has_tokenizer(checkpoint.path):  # the copy the checkpoint keeps
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(checkpoint.path)))
        validate(cfg, world_size=env.world_size)
    else:
        check_init_from(args.init_from, cfg.model)  # headers and shapes, before any process group
    corpus, byte_level, description = evaluation_corpus(
        cfg.data.source, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
        token_dtype=cfg.data.token_dtype, data_format=cfg.data.data_format, eod_token=cfg.data.eod_token,
        document_mask=cfg.data.document_mask, tokenizer=cfg.data.tokenizer,
        packing=packing_options(cfg.data, seq_len=cfg.model.seq_len))
    return EvalInputs(cfg, corpus, byte_level, description, checkpoint)


def main(argv: list[str]) -> int:
    env = LaunchEnv.from_environ()
    try:
        inputs = check_inputs(argv, env)
    except InputError as e:
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(20)  # let rank 0 print before torchrun tears the job down (as training does)
        return 2
    device = select_device(env.local_rank, inputs.cfg.device, local_world_size=env.local_world_size)
    configure_fp32_matmuls(device, inputs.cfg.plan.precision)
    if device.type == "cpu":
        configure_cpu_threads(env.local_world_size)
    init_distributed(env, device, timeout_s=inputs.cfg.collective_timeout_s)
    try:
        result = evaluate(inputs, env=env, device=device)
    except CheckpointError as e:
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown_distributed()
        return 1
    if env.rank == 0:
        report = {"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
                  "windows": result.windows, "data": inputs.description,
                  "weights": str(inputs.checkpoint.path) if inputs.checkpoint else inputs.cfg.checkpoint.init_from,
                  "step": inputs.checkpoint.step if inputs.checkpoint else None,
                  "mesh": inputs.cfg.plan.mesh_text()}
        if result.bits_per_byte is not None:
            report["bits_per_byte"] = result.bits_per_byte
        print(json.dumps(report), flush=True)
    shutdown_distributed()
    return 0


def evaluate(inputs: EvalInputs, *, env: LaunchEnv, device: torch.device) -> Evaluation:
    """Build this rank's part of the run as training does, load the weights, run every window forward."""
    cfg = inputs.cfg
    # A checkpoint's weights are loaded after the build; the build starts from the name-seeded values then.
    engine = build_engine(cfg, env=env, device=device, timeout=collective_timeout(cfg.collective_timeout_s),
                          initial_value=initial_values(cfg.checkpoint.init_from, cfg.model, seed=cfg.seed, lora=cfg.lora),
                          announce=False)
    if inputs.checkpoint is not None:
        load_model_only(engine.stages, inputs.checkpoint)
    pipeline = engine.pipeline(summed_cross_entropy(vocab_mesh=engine.vocab_mesh(), vocab_size=cfg.model.vocab_size))
    with torch.no_grad():
        return evaluate_windows(pipeline, inputs.corpus, global_batch_size=cfg.global_batch_size,
                                replica_rows=engine.replica_rows(), sum_copies=engine.layout.sum_copies,
                                byte_level=inputs.byte_level, document_mask=cfg.data.document_mask,
                                eod_without_loss=cfg.data.eod_token if cfg.data.no_loss_across_documents else None,
                                context=engine.context_slice())
