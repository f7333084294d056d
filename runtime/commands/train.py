"""``torchrun run.py --dp D --pp P --mp M ...``: train a GPT on a (dp, pp, mp) mesh.

Reading order is run order: flags -> validation -> process group -> mesh -> model -> stages
(partition, trace, TP, AC, FSDP) -> schedule -> resume from a checkpoint -> training loop -> metrics.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from compiler.flops import training_flops_per_token
from compiler.parallelize.data_parallel import DataParallelOptions
from compiler.parallelize.materialize import local_parameter_count
from compiler.parallelize.expert_parallel import moe_modules
from compiler.parallelize.stages import StageMeshes, build_local_stages
from compiler.partition import rank_costs
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES, build_schedule
from compiler.stage_plan import StagePlan, plan_stages
from models import moe_layer_names, parameter_count, spec_of
from models.spec import MOE
from runtime.checkpoint.files import CheckpointError, StartPoint, resolve_start
from runtime.checkpoint.hf_weights import check_weights, read_hf_model
from runtime.checkpoint.hf_weights import initial_values as hf_initial_values
from runtime.checkpoint.saving import Checkpointer
from runtime.checkpoint.state import TrainState, init_optimizer_state, load_checkpoint
from runtime.checkpoint.weights import read_init_weights
from runtime.commands.flags import build_parser, config_from_args
from runtime.commands.plan import auto_config
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
from runtime.distributed.collectives import all_gather_objects, broadcast_object
from runtime.distributed.cpu_binding import bind_node_ranks
from runtime.distributed.failures import PEER_FAILURE_EXIT_CODE, describe_peer_failure, describe_shared_device
from runtime.distributed.mesh import GridLayout, build_mesh, data_parallel_mesh, fsdp_mesh, grid_layout, moe_meshes
from runtime.distributed.process_group import (
    LaunchEnv,
    background_group,
    collective_timeout,
    host_group,
    init_distributed,
    shutdown_distributed,
)
from runtime.distributed.timeouts import CHECKPOINT, PhaseTimeouts
from runtime.engine.amp import build_grad_scaler, scaled_cross_entropy
from runtime.engine.data import DataError, DataSources, build_data_from_config, replica_rows
from runtime.engine.data.inputs import ContextSlice, model_input_count
from runtime.engine.experts import ExpertBalance
from runtime.engine.guards import DivergenceError, DivergenceGuard
from runtime.engine.loop import training_loop
from runtime.engine.optim import build_lr_schedule, build_optimizer
from runtime.engine.preemption import PREEMPTED_EXIT_CODE, stop_on_signals
from runtime.engine.replicate import ReplicatedGradients
from runtime.engine.step import StepContext
from runtime.engine.tied import TiedWeights
from runtime.observe.alignment import unaligned_head_note
from runtime.observe.layer_timing import measure_layer_times
from runtime.observe.metrics import MetricsLogger, Throughput
from runtime.observe.peak_flops import world_peak_flops
from runtime.observe.profile_report import profile_report
from runtime.observe.profiling import Profiler, profiled_steps

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
    configure_fp32_matmuls(device, cfg.precision)
    if device.type == "cpu":
        configure_cpu_threads(env.local_world_size)
        if not cfg.pipeline.compact_cpu_memory:
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
        line = describe_peer_failure(e, rank=env.rank, layout=grid_layout(cfg),
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
        cfg, best, notes = auto_config(args, argv, world=env.world_size)
        if env.rank == 0:
            for note in notes:
                print(note, flush=True)
            print(f"auto plan: {best.candidate.describe()} (predicted {best.step_time:.3f} s/step, "
                  f"{best.memory_per_rank / 2**30:.2f} GiB/rank)", flush=True)
    else:
        cfg = config_from_args(args, world_size=env.world_size)
    unassigned = device_assignment_error(cfg.device, local_world_size=env.local_world_size,
                                         visible=device_count(cfg.device))
    if unassigned:
        raise ConfigError(unassigned)
    data = build_data_from_config(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
                                  global_batch_size=cfg.global_batch_size, seed=cfg.seed)
    start = resolve_start(cfg.checkpoint, model=cfg.model, run_config=cfg.to_dict())
    if start.init_from and start.init_from.is_dir():  # a Hugging Face folder: headers and shapes, no tensor data
        note = check_weights(read_hf_model(start.init_from)).note()
        start.notes.extend([note] if note else [])
    elif start.init_from:
        read_init_weights(start.init_from, cfg.model)
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
    # 3. Mesh.
    layout = grid_layout(cfg)
    timeout = collective_timeout(cfg.startup_timeout_s)  # groups are made in start-up; phases.switch moves them on
    mesh = build_mesh(device.type, layout, timeout=timeout)
    dp_rank, pp_rank, _ = layout.coordinates(env.rank)
    if env.rank == 0:
        print(layout.describe(), flush=True)
        dp_cfg = cfg.data_parallel
        if dp_cfg.reshard_after_forward:
            print("  ZeRO-3: gathered parameters freed after every forward and backward, gradients reduced per micro-batch")
        if layout.dp * layout.cp > 1 and dp_cfg.reduce_dtype != "fp32":
            print(f"  gradients communicated in {dp_cfg.reduce_dtype}")

    # 4. Model, compiled into this rank's stages: cost-balanced split, trace, TP, AC, data parallelism, and
    #    storage for this rank's shards only. Rank 0 decides the split and broadcasts it: measured layer
    #    times differ between ranks, and every rank must cut the model at the same places.
    plan = broadcast_object(_stage_plan(cfg, device) if env.rank == 0 else None)
    if env.rank == 0:
        print(plan.describe(), flush=True)
    spec = SCHEDULES[cfg.pipeline.schedule]
    bound_cores = _bind_cores(cfg.pipeline.bind_cores, rank_costs(plan.stage_costs, spec.placement, pp=cfg.mesh.pp),
                              layout, env, device)
    v = cfg.pipeline.stages_per_rank
    moe = (moe_meshes(mesh, layout, sequence_parallel=cfg.sequence_parallel, timeout=timeout)
           if MOE in spec_of(cfg.model).block_kinds(cfg.model) else None)
    meshes = StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=fsdp_mesh(mesh, layout, timeout=timeout), moe=moe)
    stages = build_local_stages(
        cfg.model, blocks_per_stage=plan.blocks_per_stage,
        stage_indices=spec.stage_indices(pp_rank, pp=cfg.mesh.pp, stages_per_rank=v),
        micro_batch_size=cfg.pipeline.micro_batch_size, meshes=meshes, device=device,
        activation_checkpointing=cfg.activation_checkpointing,
        data_parallel=DataParallelOptions(zero3=cfg.data_parallel.reshard_after_forward,
                                          param_dtype=PRECISIONS[cfg.precision].autocast_dtype,
                                          reduce_dtype=_reduce_dtype(cfg.data_parallel.reduce_dtype)),
        initial_value=_initial_values(cfg, start), compile_blocks=cfg.compile_blocks,
        sequence_parallel=cfg.sequence_parallel,
        model_inputs=model_input_count(document_mask=cfg.data.document_mask, cp=cfg.mesh.cp),
        context_parallel=mesh["cp"] if cfg.mesh.cp > 1 else None,
        message_dtype=PRECISIONS[cfg.precision].autocast_dtype)
    tied = (TiedWeights(stages.named_parameters(), tied_weights=spec_of(cfg.model).tied_weights,
                        pp_group=mesh["pp"].get_group(), pp_rank=pp_rank,
                        first_pp=spec.stage_owner(0, pp=cfg.mesh.pp, stages_per_rank=v),
                        last_pp=spec.stage_owner(plan.n_stages - 1, pp=cfg.mesh.pp, stages_per_rank=v))
            if cfg.model.tie_embeddings else None)
    # Replication (DDP's layout) all-reduces the dense parameters; MoE layers are FSDP units of their own.
    in_moe = {id(p) for module in stages.modules for layer in moe_modules(module) for p in layer.parameters()}
    dense = [p for p in stages.parameters() if id(p) not in in_moe]
    replicated = (ReplicatedGradients(dense, group=data_parallel_mesh(mesh, layout, timeout=timeout).get_group(),
                                      reduce_dtype=_reduce_dtype(cfg.data_parallel.reduce_dtype),
                                      accumulations=cfg.pipeline.microbatches,
                                      deferred={id(p) for p in tied.copies} if tied else set(),
                                      stages=stages.stages)
                  if layout.replicated else None)

    # 5. Schedule, mixed precision, optimizer.
    scaler = build_grad_scaler(cfg.precision, device.type)
    vocab_parallel = cfg.mesh.mp > 1
    loss_fn = scaled_cross_entropy(scaler, microbatches=cfg.pipeline.microbatches,
                                   vocab_mesh=mesh["mp"] if vocab_parallel else None, vocab_size=cfg.model.vocab_size,
                                   over_every_position=cfg.data.no_loss_across_documents)
    schedule = build_schedule(cfg.pipeline.schedule, stages.stages, n_microbatches=cfg.pipeline.microbatches,
                              loss_fn=loss_fn)
    optimizer = build_optimizer(stages.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    lr_schedule = build_lr_schedule(optimizer, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.optim.steps)
    profiler = (Profiler(rank=env.rank, stages=stages.stages, schedule=schedule, steps=profiled_steps(cfg.optim.last_step),
                         sync=stream_synchronizer(device)) if cfg.metrics.profile else None)
    # The profiles travel to the logging rank over gloo, in host memory, whatever the world's backend.
    profile_group = host_group(cfg.startup_timeout_s) if profiler and device.type != "cpu" else None
    ctx = StepContext(
        schedule=schedule, schedule_name=cfg.pipeline.schedule, stages=stages, optimizer=optimizer, lr_schedule=lr_schedule, scaler=scaler,
        device=device, precision=cfg.precision, grad_clip=cfg.optim.grad_clip,
        loss_copies=cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.mp, plane_size=cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.mp,
        tied=tied, replicated=replicated, recorder=profiler.recorder if profiler else None,
        experts=ExpertBalance.of(
            [(n, m) for module in stages.modules for n, m in module.named_modules()],
            moe_layer_names=moe_layer_names(cfg.model), token_group=moe.tokens.get_group() if moe and moe.tokens else None,
            reports=layout.cp_index(env.rank) == 0 and layout.coordinates(env.rank)[::2] == (0, 0),
            bias_rate=cfg.expert_bias_rate, device=device, context_parallel=cfg.mesh.cp),
        microbatches=cfg.pipeline.microbatches,
    )

    # 6. Resume: every tensor is keyed by its original parameter name, so DCP reshards the saved
    #    (dp, pp, mp) layout onto this one.
    logging_rank = layout.rank(0, spec.stage_owner(plan.n_stages - 1, pp=cfg.mesh.pp, stages_per_rank=v), 0)
    init_optimizer_state(optimizer)
    guard = DivergenceGuard(cfg.guard.max_bad_steps, cfg.guard.min_loss_scale, loss_scaling=scaler.is_enabled())
    state = TrainState(stages, optimizer, lr_schedule, scaler, guard, config=cfg.to_dict())
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

    # 7. Metrics, from the last pipeline stage of replica 0, mp rank 0.
    logger = MetricsLogger(cfg.metrics.logdir, enabled=env.rank == logging_rank)
    peak_flops, peak_source = world_peak_flops(PRECISIONS[cfg.precision].dtype, device,
                                               peak_tflops=cfg.metrics.peak_tflops, world_size=env.world_size)
    throughput = Throughput(cfg.global_batch_size, cfg.model.seq_len, training_flops_per_token(cfg.model), peak_flops)
    if env.rank == logging_rank:
        print(f"data: {data.description}\nlogdir: {cfg.metrics.logdir}\n"
              f"MFU peak: {peak_flops / 1e12:.4f} TFLOP/s for the world ({peak_source})", flush=True)
        note = unaligned_head_note(cfg.model.vocab_size, mp=cfg.mesh.mp, itemsize=PRECISIONS[cfg.precision].dtype.itemsize,
                                   device_type=device.type)
        if note:
            print(note, flush=True)
    logger.text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2) + "\n```")
    logger.text("stage_plan", "```\n" + plan.describe() + "\n```")

    # 8. Train (a SIGTERM or SIGUSR1 now stops every rank after the current step, with a checkpoint).
    try:
        with stop_on_signals() as stop:
            summary = training_loop(
                ctx, data=data, replica_rows=replica_rows(cfg.global_batch_size, dp_rank, cfg.mesh.dp),
                optim=cfg.optim, data_cfg=cfg.data, metrics_cfg=cfg.metrics, throughput=throughput, logger=logger,
                is_logging_rank=env.rank == logging_rank, guard=guard, start_step=start_step,
                checkpointer=checkpointer, profiler=profiler, stop=stop, phases=phases,
                context=ContextSlice(layout.cp_index(env.rank), cfg.mesh.cp) if cfg.mesh.cp > 1 else None,
            )
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
            profiler.profiles, layout=layout, schedule=cfg.pipeline.schedule, microbatches=cfg.pipeline.microbatches,
            stages_per_rank=cfg.pipeline.stages_per_rank, logger=logger, dst=logging_rank, group=profile_group)
    summary.update(config=cfg.to_dict(), peak_flops=peak_flops, peak_flops_source=peak_source,
                   device=device_description(device), blocks_per_stage=plan.blocks_per_stage,
                   stage_costs=plan.stage_costs, stage_cost_unit=plan.unit, bound_cores=bound_cores,
                   world_size=env.world_size, parameters=parameter_count(cfg.model),
                   predicted_peak_tensor_bytes=predicted_tensor_bytes(cfg),
                   local_parameters_max=max(all_gather_objects(local_parameter_count(stages.parameters()))),
                   local_expert_parameters_max=max(all_gather_objects(local_parameter_count(
                       [p for module in stages.modules for layer in moe_modules(module) for p in layer.experts.parameters()]))))
    logger.write_json("summary.json", summary)
    logger.close()
    return summary


def _initial_values(cfg: TrainConfig, start: StartPoint) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Each parameter's full initial value by name: from ``--init-from``'s Hugging Face folder (read lazily,
    only the tensors of this rank's parameters) or export, or name-seeded."""
    if start.init_from and start.init_from.is_dir():
        return hf_initial_values(check_weights(read_hf_model(start.init_from)))
    if start.init_from:
        weights = read_init_weights(start.init_from, cfg.model)  # memory-mapped: read as shards need it
        return lambda name, shape: weights[name]
    return functools.partial(spec_of(cfg.model).initial_value, seed=cfg.seed, cfg=cfg.model)


def _reduce_dtype(name: str) -> torch.dtype | None:
    """The gradient-communication dtype FSDP casts to; None keeps the parameters' (fp32)."""
    return None if name == "fp32" else PRECISIONS[name].dtype


def _stage_plan(cfg: TrainConfig, device: torch.device) -> StagePlan:
    """Blocks per stage: ``--split auto`` balances counted FLOPs, or with ``--split-cost time`` layer times
    measured here."""
    layer_seconds = None
    if cfg.pipeline.split_cost == "time":
        layers = measure_layer_times(cfg.model, micro_batch_size=cfg.pipeline.micro_batch_size,
                                     precision=cfg.precision, device=device)
        layer_seconds = [c.seconds for c in layers]
    return plan_stages(cfg.model, n_stages=cfg.mesh.pp * cfg.pipeline.stages_per_rank,
                       micro_batch_size=cfg.pipeline.micro_batch_size, split=cfg.pipeline.split,
                       precision=cfg.precision, mp=cfg.mesh.mp, layer_seconds=layer_seconds,
                       placement=SCHEDULES[cfg.pipeline.schedule].placement)


def _bind_cores(mode: str, pp_rank_costs: list[float], layout: GridLayout, env: LaunchEnv,
                device: torch.device) -> dict[int, int] | None:
    """--bind-cores cost: pin this rank to a core chosen by its stages' work (runtime/distributed/cpu_binding.py)."""
    if mode == "none":
        return None
    if device.type != "cpu":
        if env.rank == 0:
            print(f"--bind-cores {mode}: ignored on {device.type} (every rank has its own device)", flush=True)
        return None
    bound = bind_node_ranks(pp_rank_costs, [layout.coordinates(r) for r in range(env.world_size)], mp=layout.mp, rank=env.rank, local_rank=env.local_rank,
                            local_world_size=env.local_world_size)
    if env.rank == 0:
        print("--bind-cores cost: " + ("not supported on this OS; ranks left to the scheduler" if bound is None else
              "rank -> core " + ", ".join(f"{r}->{c}" for r, c in bound.items())), flush=True)
    return bound

