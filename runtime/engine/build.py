"""Build a run once from its config: mesh, this rank's stages (cost-balanced split, trace, TP, AC, data
parallelism, storage for its shards only), tied and replicated gradients, and the pipeline schedule over them.
``train``, ``eval`` and the study's runs all build here, so they cannot disagree on how a model is made or read
(torchtitan's ``Trainer.__init__`` does this job for its trainer).

Reading order is build order: layout -> mesh -> split -> stages -> tied / replicated gradients -> schedule.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from compiler.fp8 import RECIPES
from compiler.parallelize.cross_entropy import vocabulary_shard
from compiler.parallelize.data_parallel import DataParallelOptions
from compiler.parallelize.expert_parallel import MoeMeshes, moe_modules
from compiler.parallelize.float8 import Fp8AllGatherAmaxes, Fp8Options
from compiler.parallelize.stages import LocalStages, StageMeshes, build_local_stages
from compiler.partition import rank_costs
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES, build_schedule
from compiler.stage_plan import StagePlan, plan_stages
from models import moe_layer_names, mtp_depth, spec_of, tied_weights
from models.spec import MOE
from runtime.config import TrainConfig
from runtime.distributed.collectives import broadcast_object
from runtime.distributed.cpu_binding import bind_node_ranks
from runtime.distributed.mesh import GridLayout, build_mesh, data_parallel_mesh, fsdp_mesh, grid_layout, moe_meshes
from runtime.distributed.process_group import LaunchEnv
from runtime.engine.amp import build_grad_scaler, scaled_cross_entropy
from runtime.engine.data.batches import replica_rows
from runtime.engine.data.inputs import ContextSlice, model_input_count
from runtime.engine.experts import ExpertBalance
from runtime.engine.mtp_loss import MtpObjective, mtp_objective
from runtime.engine.optim import build_lr_schedule, build_optimizer
from runtime.engine.replicate import ReplicatedGradients
from runtime.engine.step import PipelineContext, StepContext
from runtime.engine.tied import TiedWeights
from runtime.engine.token_mean import TrainedTokens, trained_token_cross_entropy
from runtime.observe.layer_timing import measure_layer_times
from runtime.observe.profiling import Profiler, StepRecorder

InitialValue = Callable[[str, tuple[int, ...]], torch.Tensor]  # a parameter's full value by name


@dataclass(frozen=True)
class Engine:
    """A run's parts on this rank, built once."""

    cfg: TrainConfig
    rank: int
    device: torch.device
    layout: GridLayout
    mesh: DeviceMesh
    stage_plan: StagePlan
    stages: LocalStages
    moe: MoeMeshes | None
    tied: TiedWeights | None
    replicated: ReplicatedGradients | None
    bound_cores: dict[int, int] | None
    fp8: Fp8Options | None = None  # --fp8: the recipe and this rank's amax guard

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def logging_rank(self) -> int:
        """The rank that logs: replica 0's last pipeline stage, mp (and cp) rank 0."""
        plan = self.cfg.plan
        last = SCHEDULES[plan.schedule].stage_owner(self.stage_plan.n_stages - 1, pp=plan.pp,
                                                    stages_per_rank=plan.stages_per_rank)
        return self.layout.rank(0, last, 0)

    def replica_rows(self) -> tuple[int, int]:
        """The rows of each global batch this rank's replica reads."""
        return replica_rows(self.cfg.global_batch_size, self.dp_rank, self.cfg.plan.dp)

    def context_slice(self) -> ContextSlice | None:
        """This rank's chunks of each sequence under context parallelism (None without it)."""
        cp = self.cfg.plan.cp
        return ContextSlice(self.layout.cp_index(self.rank), cp) if cp > 1 else None

    def vocab_mesh(self) -> DeviceMesh | None:
        """The mesh the LM head's vocabulary (and so the loss) is split over (None: whole on every rank)."""
        return self.mesh["mp"] if self.cfg.plan.mp > 1 else None

    def pipeline(self, loss_fn: Callable, *, recorder: StepRecorder | None = None) -> PipelineContext:
        """The schedule over this rank's stages with ``loss_fn`` (training's scaled mean, evaluation's sum)."""
        plan = self.cfg.plan
        schedule = build_schedule(plan.schedule, self.stages.stages, n_microbatches=plan.microbatches, loss_fn=loss_fn)
        return PipelineContext(schedule=schedule, schedule_name=plan.schedule, stages=self.stages, device=self.device,
                               precision=plan.precision, tied=self.tied, replicated=self.replicated, recorder=recorder)

    def moe_modules(self) -> list:
        return [layer for module in self.stages.modules for layer in moe_modules(module)]


def build_engine(cfg: TrainConfig, *, env: LaunchEnv, device: torch.device, initial_value: InitialValue,
                 timeout: datetime.timedelta, announce: bool = True) -> Engine:
    """This rank's part of ``cfg``'s run on the world ``init_distributed`` formed; ``initial_value`` gives every
    parameter's starting value (runtime/checkpoint/weights.py ``initial_values``); groups bound their waits by
    ``timeout``. Collective: every rank calls it. ``announce``: rank 0 prints the grid and the split."""
    plan = cfg.plan
    layout = grid_layout(plan)
    mesh = build_mesh(device.type, layout, timeout=timeout)
    _, pp_rank, _ = layout.coordinates(env.rank)
    if announce and env.rank == 0:
        print(layout.describe(), flush=True)
        if plan.reshard_after_forward:
            print("  ZeRO-3: gathered parameters freed after every forward and backward, gradients reduced per micro-batch")
        if layout.dp * layout.cp > 1 and plan.reduce_dtype != "fp32":
            print(f"  gradients communicated in {plan.reduce_dtype}")
    stage_plan = _agreed_stage_plan(cfg, env.rank, device)
    if announce and env.rank == 0:
        print(stage_plan.describe(), flush=True)
    spec = SCHEDULES[plan.schedule]
    bound_cores = _bind_cores(cfg.placement.bind_cores, rank_costs(stage_plan.stage_costs, spec.placement, pp=plan.pp),
                              layout, env, device)
    moe = (moe_meshes(mesh, layout, sequence_parallel=plan.sequence_parallel, timeout=timeout)
           if MOE in spec_of(cfg.model).block_kinds(cfg.model) else None)
    meshes = StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=fsdp_mesh(mesh, layout, timeout=timeout), moe=moe)
    dtype = PRECISIONS[plan.precision].autocast_dtype
    fp8 = Fp8Options(RECIPES[plan.fp8], all_gather=plan.fp8_all_gather) if plan.fp8 else None
    stages = build_local_stages(
        cfg.model, blocks_per_stage=stage_plan.blocks_per_stage,
        stage_indices=spec.stage_indices(pp_rank, pp=plan.pp, stages_per_rank=plan.stages_per_rank),
        micro_batch_size=plan.micro_batch_size, meshes=meshes, device=device, activation_checkpointing=plan.ac.value,
        data_parallel=DataParallelOptions(zero3=plan.reshard_after_forward, param_dtype=dtype,
                                          reduce_dtype=reduce_dtype(plan.reduce_dtype)),
        initial_value=initial_value, compile_blocks=cfg.compile_blocks, sequence_parallel=plan.sequence_parallel,
        model_inputs=model_input_count(document_mask=cfg.data.document_mask, cp=plan.cp),
        context_parallel=mesh["cp"] if plan.cp > 1 else None, message_dtype=dtype, lora=cfg.lora, fp8=fp8,
        cp_gather=plan.cp_gather)
    tied = _tied_weights(cfg, stages, mesh, pp_rank, stage_plan.n_stages)
    replicated = (_replicated_gradients(cfg, stages, data_parallel_mesh(mesh, layout, timeout=timeout), tied)
                  if layout.replicated else None)
    return Engine(cfg=cfg, rank=env.rank, device=device, layout=layout, mesh=mesh, stage_plan=stage_plan, stages=stages,
                  moe=moe, tied=tied, replicated=replicated, bound_cores=bound_cores, fp8=fp8)


def reduce_dtype(name: str) -> torch.dtype | None:
    """The gradient-communication dtype FSDP casts to; None keeps the parameters' (fp32)."""
    return None if name == "fp32" else PRECISIONS[name].dtype


def stage_plan_of(cfg: TrainConfig, device: torch.device) -> StagePlan:
    """Blocks per stage: ``--split auto`` balances counted FLOPs, or with ``--split-cost time`` layer times
    measured here."""
    plan = cfg.plan
    layer_seconds = None
    if cfg.placement.split_cost == "time":
        layers = measure_layer_times(cfg.model, micro_batch_size=plan.micro_batch_size, precision=plan.precision,
                                     device=device)
        layer_seconds = [c.seconds for c in layers]
    return plan_stages(cfg.model, n_stages=plan.n_stages, micro_batch_size=plan.micro_batch_size, split=plan.split,
                       precision=plan.precision, mp=plan.mp, layer_seconds=layer_seconds,
                       placement=SCHEDULES[plan.schedule].placement)


def _agreed_stage_plan(cfg: TrainConfig, rank: int, device: torch.device) -> StagePlan:
    """The split every rank uses. Counted FLOPs give the same split everywhere; measured layer times differ
    between ranks, so rank 0 decides and broadcasts it (every rank must cut the model at the same places)."""
    if cfg.placement.split_cost != "time":
        return stage_plan_of(cfg, device)
    return broadcast_object(stage_plan_of(cfg, device) if rank == 0 else None)


def _tied_weights(cfg: TrainConfig, stages: LocalStages, mesh: DeviceMesh, pp_rank: int,
                  n_stages: int) -> TiedWeights | None:
    """Tied embeddings (and the MTP depths' embedding) with pp > 1: a copy on the first and the last stage, their
    gradients summed point to point."""
    tied = tied_weights(cfg.model)
    if not tied or cfg.lora is not None:  # LoRA: every copy frozen, no gradient to sum
        return None
    plan, spec = cfg.plan, SCHEDULES[cfg.plan.schedule]
    return TiedWeights(stages.named_parameters(), tied_weights=tied,
                       pp_group=mesh["pp"].get_group(), pp_rank=pp_rank,
                       first_pp=spec.stage_owner(0, pp=plan.pp, stages_per_rank=plan.stages_per_rank),
                       last_pp=spec.stage_owner(n_stages - 1, pp=plan.pp, stages_per_rank=plan.stages_per_rank))


def _replicated_gradients(cfg: TrainConfig, stages: LocalStages, dp_mesh: DeviceMesh,
                          tied: TiedWeights | None) -> ReplicatedGradients:
    """Replication (DDP's layout) all-reduces the dense parameters; MoE layers are FSDP units of their own."""
    in_moe = {id(p) for module in stages.modules for layer in moe_modules(module) for p in layer.parameters()}
    dense = [p for p in stages.parameters() if id(p) not in in_moe and p.requires_grad]
    return ReplicatedGradients(dense, group=dp_mesh.get_group(), reduce_dtype=reduce_dtype(cfg.plan.reduce_dtype),
                               accumulations=cfg.plan.microbatches,
                               deferred={id(p) for p in tied.copies} if tied else set(), stages=stages.stages)


def _bind_cores(mode: str, pp_rank_costs: list[float], layout: GridLayout, env: LaunchEnv,
                device: torch.device) -> dict[int, int] | None:
    """--bind-cores cost: pin this rank to a core chosen by its stages' work (runtime/distributed/cpu_binding.py)."""
    if mode == "none":
        return None
    if device.type != "cpu":
        if env.rank == 0:
            print(f"--bind-cores {mode}: ignored on {device.type} (every rank has its own device)", flush=True)
        return None
    bound = bind_node_ranks(pp_rank_costs, [layout.coordinates(r) for r in range(env.world_size)], mp=layout.mp,
                            rank=env.rank, local_rank=env.local_rank, local_world_size=env.local_world_size)
    if env.rank == 0:
        print("--bind-cores cost: " + ("not supported on this OS; ranks left to the scheduler" if bound is None else
              "rank -> core " + ", ".join(f"{r}->{c}" for r, c in bound.items())), flush=True)
    return bound


def build_step_context(engine: Engine, *, profiler: Callable[[object], Profiler] | None = None
                       ) -> tuple[StepContext, Profiler | None]:
    """What a training step needs on top of the engine: the loss scaler and the schedule over the stages with
    training's loss (scaled for fp16, a mean over the micro-batch), AdamW and its LR schedule, and a mixture's
    per-step bookkeeping. ``profiler``: makes the step profiler from the schedule (``--profile``)."""
    cfg, plan = engine.cfg, engine.cfg.plan
    scaler = build_grad_scaler(plan.precision, engine.device.type)
    layout = engine.layout
    # Chat data: a mean over the global batch's assistant tokens (runtime/engine/token_mean.py); no MTP depths
    # (runtime/config.py refuses them).
    trained_tokens = TrainedTokens(replicas=layout.dp * layout.cp) if cfg.data.chat else None
    mtp = _mtp_objective(engine)
    loss_fn = (trained_token_cross_entropy(scaler, trained_tokens, vocab_mesh=engine.vocab_mesh(),
                                           vocab_size=cfg.model.vocab_size) if trained_tokens else
               scaled_cross_entropy(scaler, microbatches=plan.microbatches, vocab_mesh=engine.vocab_mesh(),
                                    vocab_size=cfg.model.vocab_size,
                                    over_every_position=cfg.data.no_loss_across_documents, mtp=mtp))
    pipeline = engine.pipeline(loss_fn)
    profiling = profiler(pipeline.schedule) if profiler else None
    if profiling:
        pipeline = dataclasses.replace(pipeline, recorder=profiling.recorder)
    # Trained parameters only: a frozen one (LoRA's base, a router's selection bias) has no AdamW state.
    optimizer = build_optimizer([p for p in engine.stages.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                weight_decay=cfg.optim.weight_decay)
    lr_schedule = build_lr_schedule(optimizer, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.optim.steps)
    experts = ExpertBalance.of(
        [(n, m) for module in engine.stages.modules for n, m in module.named_modules()],
        moe_layer_names=moe_layer_names(cfg.model),
        token_group=engine.moe.tokens.get_group() if engine.moe and engine.moe.tokens else None,
        reports=layout.cp_index(engine.rank) == 0 and layout.coordinates(engine.rank)[::2] == (0, 0),
        bias_rate=cfg.expert_bias_rate, device=engine.device, context_parallel=plan.cp)
    ctx = StepContext(pipeline=pipeline, optimizer=optimizer, lr_schedule=lr_schedule, scaler=scaler,
                      grad_clip=cfg.optim.grad_clip, loss_replicas=layout.plane_size, plane_size=layout.plane_size,
                      microbatches=plan.microbatches, experts=experts, trained_tokens=trained_tokens,
                      fp8_guard=engine.fp8.guard if engine.fp8 else None, mtp_depth=mtp_depth(cfg.model), mtp=mtp,
                      fp8_amaxes=Fp8AllGatherAmaxes(engine.stages.modules) if engine.fp8 and engine.fp8.all_gather else None)
    return ctx, profiling


def _mtp_objective(engine: Engine) -> MtpObjective | None:
    """The MTP depths' objective where this rank holds the last stage of a run with them (runtime/engine/mtp_loss.py)."""
    stages, depth = engine.stages, mtp_depth(engine.cfg.model)
    if not depth or not stages.has_last:
        return None
    mesh = engine.vocab_mesh()
    return mtp_objective(stages.modules[stages.indices.index(stages.num_stages - 1)], depth=depth,
                         weight=engine.cfg.mtp_loss_weight,
                         shard=vocabulary_shard(mesh, engine.cfg.model.vocab_size) if mesh is not None else None)
