"""``torchrun run.py --dp D --pp P --mp M ...``: train a GPT on a (dp, pp, mp) mesh.

Reading order is run order: flags -> validation -> process group -> the engine (mesh, stages: partition, trace,
TP, AC, FSDP; runtime/engine/build.py) -> schedule and optimizer -> resume from a checkpoint -> training loop ->
metrics.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from compiler.flops import training_flops_per_token
from compiler.lora import is_adapter
from compiler.parallelize.lora import lora_parameter_shapes
from compiler.parallelize.materialize import local_parameter_count
from compiler.precisions import PRECISIONS
from models import mtp_depth, parameter_count
from runtime.checkpoint.files import CheckpointError, StartPoint, resolve_start
from runtime.checkpoint.saving import Checkpointer
from runtime.checkpoint.state import TrainState, init_optimizer_state, load_checkpoint
from runtime.checkpoint.weights import check_init_from, initial_values
from runtime.commands.flags import build_parser, config_from_args
from runtime.commands.preflight import check_memory, node_memory, node_ranks, predicted_tensor_bytes
from runtime.config import ConfigError, TrainConfig
from runtime.device import (
    compact_cpu_heap,
    configure_cpu_threads,
    configure_fp32_matmuls,
    device_assignment_error,
    device_count,
    device_description,
    retain_cpu_heap,
    select_device,
    stream_synchronizer,
    visible_devices_setting,
)
from runtime.distributed.collectives import all_gather_objects
from runtime.distributed.failures import PEER_FAILURE_EXIT_CODE, describe_peer_failure, describe_shared_device
from runtime.distributed.mesh import grid_layout
from runtime.distributed.process_group import (
    LaunchEnv,
    background_group,
    collective_timeout,
    host_group,
    init_distributed,
    shutdown_distributed,
)
from runtime.distributed.timeouts import CHECKPOINT, PhaseTimeouts
from runtime.engine.build import Engine, build_engine, build_step_context
from runtime.engine.data import DataError, DataSources, build_data_from_config
from runtime.engine.guards import DivergenceError, DivergenceGuard
from runtime.engine.loop import Batches, TrainingLoop
from runtime.engine.preemption import PREEMPTED_EXIT_CODE, stop_on_signals
from runtime.observe.alignment import unaligned_head_note
from runtime.observe.metrics import MetricsLogger, Throughput
from runtime.observe.peak_flops import world_peak_flops
from runtime.observe.profile_report import profile_report
from runtime.observe.profiling import Profiler, profiled_steps
from runtime.observe.step_report import StepReporter

InputError = (ConfigError, DataError, CheckpointError)  # bad input: one error line, exit 2


def main(argv: list[str]) -> int:
    env = LaunchEnv.from_environ()

    # 1. Flags, data and checkpoints are checked on every rank before any process group exists, so
    #    bad input ends every rank at once with the same one-line error (printed by rank 0).
    try:
        cfg, data, start = check_inputs(argv, env)
    except InputError as e:
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank once one exits: give rank 0 (slower to get here on a loaded machine)
            # time to print the message before this rank's exit tears the job down. Bounded; rank 0's exit
            # ends this wait early.
            time.sleep(20)
        return 2
    if env.rank == 0:
        for note in start.notes:
            print(note, file=sys.stderr if note.startswith("warning") else sys.stdout, flush=True)
    if start.resume and start.resume.step >= cfg.optim.last_step:
        if env.rank == 0:
            print(f"nothing to train: {start.resume.path} is at step {start.resume.step}, this run ends at step "
                  f"{cfg.optim.last_step}", flush=True)
        return 0

    # 2. Device and process group.
    device = select_device(env.local_rank, cfg.device, local_world_size=env.local_world_size)
    configure_fp32_matmuls(device, cfg.plan.precision)
    if device.type == "cpu":
        configure_cpu_threads(env.local_world_size)
        if not cfg.placement.compact_cpu_memory:
            retain_cpu_heap()  # no page faults per micro-batch (without glibc: the C library's default)
        elif not compact_cpu_heap() and env.rank == 0:
            print("warning: --compact-cpu-memory needs glibc's mallopt; not available here, ignored", flush=True)
    try:
        init_distributed(env, device, timeout_s=cfg.startup_timeout_s)
    except dist.DistBackendError as e:
        shared = describe_shared_device(e, visible_devices=visible_devices_setting(device.type))
        if shared is None:
            raise
        if shared.rank < shared.other:  # one line per pair of ranks on one GPU
            print(f"error: {shared.line}", file=sys.stderr, flush=True)
        else:
            time.sleep(20)  # as for bad input: the printing rank's exit ends this wait early
        return 2
    try:
        summary = train(cfg, data, start, env=env, device=device)
    except (CheckpointError, DivergenceError) as e:
        # Raised on every rank at the same point (the guard and checkpoint code agree across ranks).
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown_distributed()
        return 1
    except RuntimeError as e:
        line = describe_peer_failure(e, rank=env.rank, layout=grid_layout(cfg.plan),
                                     timeouts=cfg.timeouts)
        if line is None:
            shutdown_distributed()
            raise
        # A peer is stuck or gone: tearing the process group down could wait on it, so leave it to the exit.
        print(f"error: {line}", file=sys.stderr, flush=True)
        return PEER_FAILURE_EXIT_CODE
    shutdown_distributed()
    return PREEMPTED_EXIT_CODE if summary["preempted_at"] else 0


def check_inputs(argv: list[str], env: LaunchEnv) -> tuple[TrainConfig, DataSources, StartPoint]:
    """Everything that can be wrong with the user's input, checked without a process group.
    Raises one of ``InputError`` with a one-line message naming the flag and the valid values."""
    args = build_parser().parse_args(argv)
    if args.auto:
        from runtime.commands.auto import auto_config  # the planner's search is loaded only for --auto

        cfg, best, notes = auto_config(args, argv, world=env.world_size)
        if env.rank == 0:
            for note in notes:
                print(note, flush=True)
            print(f"auto plan: {best.plan.describe()} (predicted {best.step_time:.3f} s/step, "
                  f"{best.memory_per_rank / 2**30:.2f} GiB/rank)", flush=True)
    else:
        cfg = config_from_args(args, world_size=env.world_size)
    unassigned = device_assignment_error(cfg.device, local_world_size=env.local_world_size,
                                         visible=device_count(cfg.device))
    if unassigned:
        raise ConfigError(unassigned)
    data = build_data_from_config(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
                                  global_batch_size=cfg.global_batch_size, seed=cfg.seed)
    start = resolve_start(cfg.checkpoint, model=cfg.model, run_config=cfg.to_dict(), lora=cfg.lora)
    note = check_init_from(str(start.init_from) if start.init_from else None, cfg.model)  # headers and shapes only
    start.notes.extend([note] if note else [])
    if not args.skip_memory_check:
        # Before anything is built: a configuration predicted to overflow the node stops here, naming what fits.
        warning = check_memory(cfg, world=env.world_size, memory=node_memory(env.local_rank, cfg.device),
                               node_ranks=node_ranks(rank=env.rank, local_world_size=env.local_world_size))
        if warning and env.rank == 0:
            print(warning, flush=True)
    return cfg, data, start


def train(cfg: TrainConfig, data: DataSources, start: StartPoint, *, env: LaunchEnv, device: torch.device) -> dict:
    """Train on the world ``init_distributed`` formed. Every wait on a peer is bounded by the timeout of the
    phase the rank is in (start-up until the first step is done, then steady steps, checkpoint I/O around
    saves and loads: runtime/distributed/timeouts.py); an error leaving it is tagged with that phase."""
    phases = PhaseTimeouts(cfg.timeouts)
    with phases.noting():
        return _train(cfg, data, start, env=env, device=device, phases=phases)


def _train(cfg: TrainConfig, data: DataSources, start: StartPoint, *, env: LaunchEnv, device: torch.device,
           phases: PhaseTimeouts) -> dict:
    torch.manual_seed(cfg.seed)
    # 3. Mesh and this rank's stages (runtime/engine/build.py); groups are made in start-up, phases.switch moves
    #    them on.
    engine = build_engine(cfg, env=env, device=device, timeout=collective_timeout(cfg.startup_timeout_s),
                          initial_value=initial_values(str(start.init_from) if start.init_from else None, cfg.model,
                                                       seed=cfg.seed, lora=cfg.lora))
    # 4. Schedule, mixed precision, optimizer.
    make_profiler = (lambda schedule: Profiler(rank=env.rank, stages=engine.stages.stages, schedule=schedule,
                                               steps=profiled_steps(cfg.optim.last_step),
                                               sync=stream_synchronizer(device))) if cfg.metrics.profile else None
    ctx, profiler = build_step_context(engine, profiler=make_profiler)
    # The profiles travel to the logging rank over gloo, in host memory, whatever the world's backend.
    profile_group = host_group(cfg.startup_timeout_s) if profiler and device.type != "cpu" else None

    # 5. Resume: every tensor is keyed by its original parameter name, so DCP reshards the saved layout onto this one.
    logging_rank = engine.logging_rank
    init_optimizer_state(ctx.optimizer)
    guard = DivergenceGuard(cfg.guard.max_bad_steps, cfg.guard.min_loss_scale, loss_scaling=ctx.scaler.is_enabled())
    state = TrainState(engine.stages, ctx.optimizer, ctx.lr_schedule, ctx.scaler, guard, config=cfg.to_dict())
    start_step = 0
    if start.resume:
        with phases.during(CHECKPOINT):
            start_step = load_checkpoint(state, start.resume)
    checkpointer = (Checkpointer(Path(cfg.checkpoint.dir), cfg.checkpoint.every, cfg.checkpoint.keep, state,
                                 verbose=env.rank == logging_rank,
                                 # its waits are checkpoint I/O whatever the training thread is doing
                                 group=phases.exempt(background_group(cfg.checkpoint_timeout_s))
                                 if cfg.checkpoint.async_write else None)
                    if cfg.checkpoint.dir else None)

    # 6. Metrics, from the last pipeline stage of replica 0, mp rank 0.
    logger = MetricsLogger(cfg.metrics.logdir, enabled=env.rank == logging_rank)
    peak_flops, peak_source = world_peak_flops(PRECISIONS[cfg.plan.precision].dtype, device,
                                               peak_tflops=cfg.metrics.peak_tflops, world_size=env.world_size)
    throughput = Throughput(cfg.global_batch_size, cfg.model.seq_len, training_flops_per_token(cfg.model), peak_flops)
    if env.rank == logging_rank:
        print(f"data: {data.description}\nlogdir: {cfg.metrics.logdir}\n"
              f"MFU peak: {peak_flops / 1e12:.4f} TFLOP/s for the world ({peak_source})", flush=True)
        note = unaligned_head_note(cfg.model.vocab_size, mp=cfg.plan.mp,
                                   itemsize=PRECISIONS[cfg.plan.precision].dtype.itemsize, device_type=device.type)
        if note:
            print(note, flush=True)
        if cfg.lora is not None:
            lora = cfg.lora
            print(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.targets)}: {lora_parameters(cfg):,} "
                  f"adapter parameters trained, the model's {parameter_count(cfg.model):,} frozen", flush=True)
    logger.text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2) + "\n```")
    logger.text("stage_plan", "```\n" + engine.stage_plan.describe() + "\n```")

    # 7. Train (a SIGTERM or SIGUSR1 now stops every rank after the current step, with a checkpoint).
    reporter = StepReporter(logger=logger, throughput=throughput, is_logging_rank=env.rank == logging_rank,
                            log_every=cfg.metrics.log_every, steps=cfg.optim.steps, data=data)
    batches = Batches(data, cfg.data, engine.replica_rows(), device, engine.context_slice(), mtp_depth(cfg.model))
    try:
        with stop_on_signals() as stop:
            loop = TrainingLoop(ctx, batches, reporter, guard, phases, checkpointer=checkpointer, profiler=profiler,
                                stop=stop, profile_memory=cfg.metrics.profile_memory)
            summary = loop.run(start_step=start_step, last_step=cfg.optim.last_step)
    except (CheckpointError, DivergenceError):
        # Raised on every rank at the same point: a background save of an earlier step can still be published.
        if checkpointer and checkpointer.pending:
            try:
                with phases.during(CHECKPOINT):
                    checkpointer.finish()
            except CheckpointError as e:
                if env.rank == 0:
                    print(f"error: {e}", file=sys.stderr, flush=True)
        logger.close()  # keep the scalars logged up to the failure
        raise
    if profiler:
        profiler.close()
        summary["profile"] = profile_report(
            profiler.profiles, layout=engine.layout, schedule=cfg.plan.schedule, microbatches=cfg.plan.microbatches,
            stages_per_rank=cfg.plan.stages_per_rank, logger=logger, dst=logging_rank, group=profile_group)
    summary.update(run_facts(engine, env=env, peak=(peak_flops, peak_source)))
    logger.write_json("summary.json", summary)
    logger.close()
    return summary


def lora_parameters(cfg: TrainConfig) -> int:
    """Elements of the LoRA adapters a run trains (0 without LoRA)."""
    shapes = lora_parameter_shapes(cfg.model, cfg.lora)
    return sum(math.prod(shape) for name, shape in shapes.items() if is_adapter(name))


def run_facts(engine: Engine, *, env: LaunchEnv, peak: tuple[float, str]) -> dict:
    """What summary.json records of the run beside the loop's figures: its config, device, split, parameters
    per rank and the memory model's prediction."""
    cfg, stage_plan = engine.cfg, engine.stage_plan
    experts = [p for layer in engine.moe_modules() for p in layer.experts.parameters()]
    return dict(config=cfg.to_dict(), peak_flops=peak[0], peak_flops_source=peak[1],
                device=device_description(engine.device), blocks_per_stage=stage_plan.blocks_per_stage,
                stage_costs=stage_plan.stage_costs, stage_cost_unit=stage_plan.unit, bound_cores=engine.bound_cores,
                world_size=env.world_size, parameters=parameter_count(cfg.model), lora_parameters=lora_parameters(cfg),
                predicted_peak_tensor_bytes=predicted_tensor_bytes(cfg),
                local_parameters_max=max(all_gather_objects(local_parameter_count(engine.stages.parameters()))),
                local_expert_parameters_max=max(all_gather_objects(local_parameter_count(experts))))
