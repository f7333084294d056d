"""``python run.py eval``: the loss and perplexity of a checkpoint (or an export) over a whole validation set.

    python run.py eval --checkpoint ckpt --data fineweb10B/                     # its *_val_* shards
    python run.py eval --init-from model.pt --model small --data val.bin        # an export: give its model flags
    python run.py eval --checkpoint ckpt --data held_out.txt                    # text, with the checkpoint's tokenizer
    torchrun --nproc_per_node=8 run.py eval --checkpoint ckpt --data val.bin --dp 2 --pp 2 --mp 2

Every window of the data set is evaluated once (the format's validation split when it names one:
llm.c ``*_val_*`` shards, nanoGPT ``val.bin``; else every file), forward only, through the same stages
and schedule as training, on any mesh; the result is one JSON line: loss, perplexity, bits per byte
for byte-level text, tokens and windows. The flags are training's groups that evaluation reads (mesh,
model, micro-batching, precision, data; runtime/commands/flag_groups.py), nothing of optimisation,
checkpointing or metrics; ``--precision`` defaults to fp32 here. A checkpoint brings its own model shape;
``--seq-len`` evaluates it on windows of another length, up to the model's context.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from compiler.parallelize.data_parallel import DataParallelOptions
from compiler.parallelize.stages import StageMeshes, build_local_stages
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES, build_schedule
from compiler.stage_plan import plan_stages
from models import config_from_dict, moe_layer_names, spec_of, with_window
from runtime.checkpoint.files import CheckpointError, CheckpointInfo
from runtime.checkpoint.state import load_model_only
from runtime.checkpoint.weights import read_init_weights, resolve_checkpoint
from runtime.commands import flag_groups as groups
from runtime.commands.flags import config_from_args
from runtime.config import ConfigError, TrainConfig, validate
from runtime.device import configure_cpu_threads, configure_fp32_matmuls, select_device
from runtime.distributed.mesh import build_mesh, fsdp_mesh, grid_layout, moe_meshes
from runtime.engine.data.inputs import ContextSlice, model_input_count
from runtime.distributed.process_group import LaunchEnv, collective_timeout, init_distributed, shutdown_distributed
from runtime.engine.data import DataError, evaluation_corpus, replica_rows
from runtime.engine.data.corpus import Corpus
from runtime.engine.evaluation import Evaluation, evaluate_windows, summed_cross_entropy
from runtime.tokenizer import has_tokenizer
from runtime.engine.step import StepContext

InputError = (ConfigError, DataError, CheckpointError)


# Training's flag groups that evaluation reads (forward only: no optimiser, checkpoint writing or metrics).
EVAL_FLAG_GROUPS = (groups.add_mesh_flags, groups.add_data_parallel_flags, groups.add_model_flags,
                    groups.add_pipeline_flags, groups.add_precision_flag, groups.add_run_flags, groups.add_init_flag,
                    groups.add_data_flags)


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
    corpus: Corpus
    byte_level: bool
    description: str
    checkpoint: CheckpointInfo | None  # else the weights come from --init-from
    weights: dict[str, torch.Tensor] | None


def check_inputs(argv: list[str], env: LaunchEnv) -> EvalInputs:
    """Every input checked on every rank before any process group (one-line errors, as training's)."""
    args = build_parser().parse_args(argv)
    if (args.checkpoint is None) == (args.init_from is None):
        raise ConfigError("run.py eval needs exactly one of --checkpoint DIR and --init-from FILE")
    cfg = config_from_args(groups.with_training_defaults(args), world_size=env.world_size)
    checkpoint, weights = None, None
    if args.checkpoint:
        checkpoint = resolve_checkpoint(Path(args.checkpoint))
        model = config_from_dict(checkpoint.config["model"])  # the checkpoint's shape, at --seq-len if given
        try:
            model = with_window(model, args.seq_len) if args.seq_len else model
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cfg = dataclasses.replace(cfg, model=model)
        if cfg.data.tokenizer is None and has_tokenizer(checkpoint.path):  # the copy the checkpoint keeps
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(checkpoint.path)))
        validate(cfg, world_size=env.world_size)
    else:
        weights = read_init_weights(Path(args.init_from), cfg.model)
    corpus, byte_level, description = evaluation_corpus(
        cfg.data.source, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
        token_dtype=cfg.data.token_dtype, data_format=cfg.data.data_format, eod_token=cfg.data.eod_token,
        document_mask=cfg.data.document_mask, tokenizer=cfg.data.tokenizer)
    return EvalInputs(cfg, corpus, byte_level, description, checkpoint, weights)


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
    configure_fp32_matmuls(device, inputs.cfg.precision)
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
                  "mesh": dataclasses.asdict(inputs.cfg.mesh)}
        if result.bits_per_byte is not None:
            report["bits_per_byte"] = result.bits_per_byte
        print(json.dumps(report), flush=True)
    shutdown_distributed()
    return 0


def evaluate(inputs: EvalInputs, *, env: LaunchEnv, device: torch.device) -> Evaluation:
    """Build this rank's stages as training does (forward only), load the weights, run every window."""
    cfg = inputs.cfg
    layout = grid_layout(cfg)
    timeout = collective_timeout(cfg.collective_timeout_s)
    mesh = build_mesh(device.type, layout, timeout=timeout)
    dp_rank, pp_rank, _ = layout.coordinates(env.rank)
    spec = SCHEDULES[cfg.pipeline.schedule]
    v = cfg.pipeline.stages_per_rank
    # The counted-FLOPs split: the same on every rank without a broadcast, and any split gives the same losses.
    plan = plan_stages(cfg.model, n_stages=cfg.mesh.pp * v, micro_batch_size=cfg.pipeline.micro_batch_size,
                       split=cfg.pipeline.split, precision=cfg.precision, mp=cfg.mesh.mp, layer_seconds=None,
                       placement=spec.placement)
    weights = inputs.weights
    values = ((lambda name, shape: weights[name]) if weights is not None else
              lambda name, shape: spec_of(cfg.model).initial_value(name, shape, seed=cfg.seed, cfg=cfg.model))
    stages = build_local_stages(
        cfg.model, blocks_per_stage=plan.blocks_per_stage,
        stage_indices=spec.stage_indices(pp_rank, pp=cfg.mesh.pp, stages_per_rank=v),
        micro_batch_size=cfg.pipeline.micro_batch_size, device=device, activation_checkpointing="none",
        meshes=StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=fsdp_mesh(mesh, layout, timeout=timeout),
                           moe=(moe_meshes(mesh, layout, sequence_parallel=cfg.sequence_parallel, timeout=timeout)
                                if moe_layer_names(cfg.model) else None)),
        data_parallel=DataParallelOptions(zero3=cfg.data_parallel.reshard_after_forward,
                                          param_dtype=PRECISIONS[cfg.precision].autocast_dtype, reduce_dtype=None),
        initial_value=values, sequence_parallel=cfg.sequence_parallel,
        model_inputs=model_input_count(document_mask=cfg.data.document_mask, cp=cfg.mesh.cp),
        context_parallel=mesh["cp"] if cfg.mesh.cp > 1 else None)
    if inputs.checkpoint is not None:
        load_model_only(stages, inputs.checkpoint)
    vocab_parallel = cfg.mesh.mp > 1
    schedule = build_schedule(cfg.pipeline.schedule, stages.stages, n_microbatches=cfg.pipeline.microbatches,
                              loss_fn=summed_cross_entropy(vocab_mesh=mesh["mp"] if vocab_parallel else None,
                                                           vocab_size=cfg.model.vocab_size))
    ctx = StepContext(schedule=schedule, schedule_name=cfg.pipeline.schedule, stages=stages, optimizer=None,
                      lr_schedule=None, scaler=None, device=device,
                      precision=cfg.precision, grad_clip=0.0, loss_copies=cfg.mesh.mp,
                      plane_size=cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.mp)
    with torch.no_grad():
        return evaluate_windows(ctx, inputs.corpus, global_batch_size=cfg.global_batch_size,
                                replica_rows=replica_rows(cfg.global_batch_size, dp_rank, cfg.mesh.dp),
                                loss_copies=cfg.mesh.mp, byte_level=inputs.byte_level,
                                document_mask=cfg.data.document_mask,
                                eod_without_loss=cfg.data.eod_token if cfg.data.no_loss_across_documents else None,
                                context=ContextSlice(layout.cp_index(env.rank), cfg.mesh.cp) if cfg.mesh.cp > 1 else None)
