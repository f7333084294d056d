"""One plan priced: its time (compiler/planner/step.py over the layer table, layers.py) and its memory per pp rank
(memory_model.py over the saved activations, activations.py), on one cluster with one engine's traits.
``Pricer`` caches what plans of one shape share: the engine's split per (stages, placement), each rank's
holdings, layer tables per group and each rank's load."""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiler.lora import LoraConfig
from compiler.parallel_plan import ParallelPlan
from compiler.parallelize.cross_entropy import loss_chunk_bytes
from compiler.planner.activations import Context, block_memory, embedding_memory, head_memory, mtp_saved_bytes
from compiler.planner.cluster import Cluster
from compiler.planner.engines import THIS_ENGINE, EngineTraits
from compiler.planner.float8_weights import float8_block_weights, float8_mtp_weights, largest_float8_weight
from compiler.planner.layers import LayerTable, Setup, layer_table
from compiler.planner.memory_model import NO_FP8_GATHER, DataParallelLayout, Fp8Gathered, RankLoad, rank_memory
from compiler.planner.shape import (
    DENSE,
    MOE,
    DecoderShape,
    _block_matrices,
    block_params,
    embedding_params,
    hardware_flops_per_token,
    head_params,
    lora_block_params,
    mlp_kind,
    model_flops_per_token,
    mtp_params,
)
from compiler.planner.split import Holding, blocks_per_stage, rank_holdings
from compiler.planner.step import DataParallelGroups, StepBreakdown, StepTerms, step_time
from compiler.planner.work import block_work, head_work
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES


@dataclass(frozen=True)
class Estimate:
    plan: ParallelPlan
    feasible: bool
    reason: str | None
    step_time: float | None = None
    tokens_per_sec: float | None = None
    mfu: float | None = None
    memory_per_rank: float | None = None  # the fullest pp rank's tensor bytes
    memory_limit: float | None = None
    breakdown: StepBreakdown | None = None
    terms: StepTerms | None = None
    blocks_per_stage: tuple[int, ...] | None = None
    model_tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None
    rank_memory: tuple[float, ...] = ()  # per pp rank

    @property
    def fits(self) -> bool:
        return self.memory_per_rank is not None and self.memory_per_rank <= self.memory_limit

    def to_json(self) -> dict:
        """The PLAN object of ``run.py plan --json``."""
        c = self.plan
        return {"dp": c.dp, "pp": c.pp, "mp": c.mp, "cp": c.cp, "ep": c.ep, "schedule": c.schedule,
                "stages_per_rank": c.stages_per_rank, "micro_batch_size": c.micro_batch_size,
                "activation_checkpointing": c.ac, "sequence_parallel": c.sequence_parallel,
                "chunked_loss": c.chunked_loss, "dp_mode": c.dp_mode, "precision": c.precision, "fp8": c.fp8,
                "fp8_all_gather": c.fp8_all_gather, "cp_gather": c.cp_gather,
                "step_time_s": self.step_time, "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "memory_gib_per_gpu": (self.memory_per_rank or 0) / 2**30, "fits": self.fits,
                "breakdown": self.breakdown.to_dict() if self.breakdown else None}

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "describe": self.plan.describe(), "feasible": self.feasible,
                "reason": self.reason, "step_time_s": self.step_time, "tokens_per_sec": self.tokens_per_sec,
                "mfu": self.mfu, "memory_per_rank_bytes": self.memory_per_rank,
                "blocks_per_stage": list(self.blocks_per_stage or []),
                "breakdown": self.breakdown.to_dict() if self.breakdown else None}


class Pricer:
    """Prices plans of one shape on one cluster with one engine's traits; caches splits and layer tables."""

    def __init__(self, shape: DecoderShape, cluster: Cluster, traits: EngineTraits = THIS_ENGINE, *,
                 lora: LoraConfig | None = None):
        """``lora``: the base frozen and LoRA's adapters trained (their memory; the step is priced as full training's,
        an upper bound: the frozen weights' gradient products and reductions do not run)."""
        self.shape, self.cluster, self.traits, self.lora = shape, cluster, traits, lora
        self._splits: dict = {}
        self._tables: dict = {}
        self._holdings: dict = {}
        self._loads: dict = {}
        head = head_work(shape, micro_batch_size=1, mp=1, cp=1, precision="fp32").counted_flops
        blocks = [block_work(shape, k, micro_batch_size=1, mp=1, cp=1, ep=1, precision="fp32",
                             sequence_parallel=False, traits=traits).counted_flops for k in shape.kinds()]
        self.split_costs = (0.0, *blocks, head)  # FLOP ratios do not depend on mp, the micro-batch or precision
        self.model_flops = model_flops_per_token(shape)
        self.hardware_flops = {ac: hardware_flops_per_token(shape, activation_checkpointing=ac) for ac in (False, True)}

    def split(self, n_stages: int, placement: str) -> tuple[int, ...]:
        key = (n_stages, placement)
        if key not in self._splits:
            self._splits[key] = tuple(blocks_per_stage(self.split_costs, n_stages, placement))
        return self._splits[key]

    def holdings(self, schedule: str, pp: int, v: int) -> dict[Holding, int]:
        """Distinct holdings -> the first pp rank holding so (the first holds the most micro-batches in flight)."""
        key = (schedule, pp, v)
        if key not in self._holdings:
            sizes = self.split(pp * v, SCHEDULES[schedule].placement)
            out: dict[Holding, int] = {}
            for r, h in enumerate(rank_holdings(self.shape.kinds(), list(sizes), schedule, pp, v)):
                out.setdefault(h, r)
            self._holdings[key] = out
        return self._holdings[key]

    def table(self, s: Setup) -> LayerTable:
        if s not in self._tables:
            self._tables[s] = layer_table(self.shape, self.cluster, self.traits, s)
        return self._tables[s]

    def setup(self, c: ParallelPlan) -> Setup:
        return Setup(c.micro_batch_size, c.precision, c.mp, c.cp, c.ep, c.sequence_parallel, c.ac, c.dp, c.pp, c.fp8,
                     c.cp_gather)

    def _load(self, c: ParallelPlan, h: Holding) -> RankLoad:
        fsdp = DataParallelGroups.of(c).dense_shard > 1
        key = (h, c.micro_batch_size, c.precision, c.mp, c.cp, c.ep, c.sequence_parallel, c.ac, c.chunked_loss, fsdp,
               c.fp8, c.fp8_all_gather, c.cp_gather)
        if key not in self._loads:
            self._loads[key] = self._rank_load(c, h, fsdp)
        return self._loads[key]

    def _rank_load(self, c: ParallelPlan, h: Holding, fsdp: bool) -> RankLoad:
        shape, dtype = self.shape, PRECISIONS[c.precision].autocast_dtype
        residual = dtype.itemsize if dtype and fsdp else 4
        ctx = Context(c.micro_batch_size, c.precision, c.mp, c.cp, c.sequence_parallel, c.ac,
                      self.traits.activations, residual, c.chunked_loss, self.cluster.device.kind == "cpu",
                      self.traits.selective_policy, loss_chunk_bytes(self.cluster.device.kind),
                      cp_halos=self.traits.cp_halos, moe_shards_need_sp=self.traits.moe_shards_need_sp,
                      fp8=c.fp8 is not None, cp_gather=c.cp_gather)
        dense = experts = saved = recompute = transient = backward = forward = copies = head_saved = 0.0
        units = []  # (parameters, those gathered in FP8) of each FSDP unit
        gathers_fp8 = c.fp8 is not None and c.fp8_all_gather
        fp8_params, fp8_weights = 0.0, 0
        # a Float8 linear's backward's copies of its weight (devices.py), one byte more where it quantizes W itself
        per_weight = self.cluster.device.fp8_product_bytes_per_weight if c.fp8 is not None else 0
        per_weight += 1 if per_weight and not gathers_fp8 else 0
        a = PRECISIONS[c.precision].dtype.itemsize if dtype else 0
        for kind, n in h.kinds:
            p = block_params(shape, c.mp, kind=kind, ep=c.ep)
            m = block_memory(shape, kind, ctx)
            dense, experts = dense + n * p.dense, experts + n * p.experts
            saved, recompute, transient = saved + n * m.saved, max(recompute, m.recompute), max(transient, m.transient)
            fp8_product = per_weight * largest_float8_weight(shape, c.mp, kind=kind) if per_weight else 0
            backward, forward = max(backward, m.backward + fp8_product), max(forward, m.forward)
            mats = _block_matrices(shape, c.mp) if mlp_kind(kind) == DENSE else {}
            copies += n * (sum(i * o for i, o in mats.values()) + (p.experts if mlp_kind(kind) == MOE else 0)) * a
            fp8 = float8_block_weights(shape, c.mp, kind=kind) if gathers_fp8 else NO_FP8_GATHER
            fp8_params, fp8_weights = fp8_params + n * fp8.params, fp8_weights + n * fp8.weights
            units.append((p.total, fp8))
        if h.embedding:
            dense += embedding_params(shape, c.mp)
            saved += embedding_memory(shape, ctx)
            units.append((embedding_params(shape, c.mp), NO_FP8_GATHER))
        if h.head:
            dense += head_params(shape, c.mp)
            head = head_memory(shape, ctx)
            saved, transient, head_saved = saved + head.saved, max(transient, head.transient), head.saved
            backward -= head.saved - head.kept  # the blocks' backward runs after the head's has freed its tensors
            copies += -(-shape.vocab_size // c.mp) * shape.d_model * a
            units.append((head_params(shape, c.mp), NO_FP8_GATHER))
            if shape.mtp_depth:  # the MTP depths beside the head (models/common/mtp.py), held by the last stage
                mtp = mtp_params(shape, c.mp, ep=c.ep)
                dense, experts = dense + mtp.dense, experts + mtp.experts
                depths = mtp_saved_bytes(shape, ctx)
                saved, head_saved = saved + depths, head_saved + depths
                units.extend((block_params(shape, c.mp, kind=k, ep=c.ep).total,
                              float8_block_weights(shape, c.mp, kind=k) if gathers_fp8 else NO_FP8_GATHER)
                             for k in shape.mtp_kinds())
                if gathers_fp8:
                    fp8 = float8_mtp_weights(shape, c.mp)
                    fp8_params, fp8_weights = fp8_params + fp8.params, fp8_weights + fp8.weights
        if shape.tied and h.embedding and h.head:  # one copy of a tied weight on a rank holding both ends
            dense -= -(-shape.vocab_size // c.mp) * shape.d_model
        transient = max(transient, backward)  # the peak is in one phase: the head's backward or a block's
        # or a block's forward (activations.py ``BlockMemory.forward``), before the head saves and, but under full
        # checkpointing (its recompute runs the forward again), with no block recomputed
        transient = max(transient, forward - head_saved - (recompute if c.ac != "full" else 0.0))
        buffers = self.cluster.device.tp_buffers_per_block if c.mp > 1 and c.ac != "full" else 0
        tokens = c.micro_batch_size * shape.seq_len / c.cp
        largest, largest_fp8 = max(units, key=lambda unit: unit[0])
        load = RankLoad(dense, experts, largest, saved, recompute, transient, copies, h.blocks,
                        buffers * tokens * shape.d_model * 4, head_saved,
                        fp8_gathered=Fp8Gathered(fp8_params, fp8_weights), fp8_gathered_unit=largest_fp8)
        return self._with_adapters(load, c, h) if self.lora is not None else load

    def _with_adapters(self, load: RankLoad, c: ParallelPlan, h: Holding) -> RankLoad:
        """The rank's load under LoRA: its parameters frozen, its blocks' adapters trained; autocast caches copies
        of the adapters only (the frozen weights are cast at each use)."""
        lora = self.lora
        adapters = [(n, lora_block_params(self.shape, c.mp, kind=kind, ep=c.ep, rank=lora.rank, targets=lora.targets))
                    for kind, n in h.kinds]
        dense, experts = (sum(n * getattr(p, part) for n, p in adapters) for part in ("dense", "experts"))
        itemsize = PRECISIONS[c.precision].dtype.itemsize if PRECISIONS[c.precision].autocast_dtype else 0
        return replace(load, dense_params=load.dense_params + dense, expert_params=load.expert_params + experts,
                       largest_unit=load.largest_unit + max((p.total for _, p in adapters), default=0),
                       weight_copy_bytes=(dense + experts) * itemsize, frozen_dense=load.dense_params,
                       frozen_experts=load.expert_params, frozen_bytes=2 if lora.base_dtype == "bf16" else 4)

    def memory(self, c: ParallelPlan) -> tuple[float, ...]:
        """Tensor bytes of each distinct pp rank (compiler/planner/memory_model.py)."""
        g = DataParallelGroups.of(c)
        dtype = PRECISIONS[c.precision].autocast_dtype
        gathered = dtype.itemsize if dtype else 4
        copies = self.cluster.device.reduce_scatter_copies_input
        dense = DataParallelLayout(g.dense, g.dense_shard, c.reshard_after_forward, gathered, copies)
        experts = DataParallelLayout(g.experts, g.experts_shard, c.reshard_after_forward, gathered, copies)
        return tuple(rank_memory(self._load(c, h), schedule=c.schedule, p=c.pp, m=c.microbatches,
                                 v=c.stages_per_rank, rank=r, dense=dense, experts=experts).total
                     for h, r in self.holdings(c.schedule, c.pp, c.stages_per_rank).items())

    def rank_memories(self, c: ParallelPlan) -> list[float]:
        """Tensor bytes of every pp rank, in rank order."""
        g = DataParallelGroups.of(c)
        dtype = PRECISIONS[c.precision].autocast_dtype
        gathered = dtype.itemsize if dtype else 4
        copies = self.cluster.device.reduce_scatter_copies_input
        dense = DataParallelLayout(g.dense, g.dense_shard, c.reshard_after_forward, gathered, copies)
        experts = DataParallelLayout(g.experts, g.experts_shard, c.reshard_after_forward, gathered, copies)
        sizes = self.split(c.pp * c.stages_per_rank, SCHEDULES[c.schedule].placement)
        holdings = rank_holdings(self.shape.kinds(), list(sizes), c.schedule, c.pp, c.stages_per_rank)
        return [rank_memory(self._load(c, h), schedule=c.schedule, p=c.pp, m=c.microbatches, v=c.stages_per_rank,
                            rank=r, dense=dense, experts=experts).total for r, h in enumerate(holdings)]

    def memory_floor(self, c: ParallelPlan) -> float:
        """A lower bound of ``memory(c)`` over every DP mode and loss: the state sharded over the whole
        data-parallel groups, activations with the chunked loss and FSDP's compute-dtype residual."""
        g = DataParallelGroups.of(c)
        lowest = replace(c, chunked_loss=True, dp_shard=None if c.dp > 1 else c.dp_shard)
        floor = 0.0
        for h, r in self.holdings(c.schedule, c.pp, c.stages_per_rank).items():
            load = self._load(lowest, h)
            in_flight = SCHEDULES[c.schedule].stage_microbatches_in_flight(p=c.pp, m=c.microbatches,
                                                                            v=c.stages_per_rank, rank=r)
            weights = sum((16 * (params - frozen) + load.frozen_bytes * frozen) / group for params, frozen, group in (
                (load.dense_params, load.frozen_dense, g.dense), (load.expert_params, load.frozen_experts, g.experts)))
            activations = in_flight * (load.saved_bytes + load.blocks * load.tp_buffer_bytes) / c.stages_per_rank
            floor = max(floor, weights + activations + load.recompute_bytes + load.transient_bytes)
        return floor

    def memory_limit(self, c: ParallelPlan, headroom: float = 0.0) -> float:
        return self.cluster.memory_per_rank(c.world) * (1 - headroom)

    def price(self, c: ParallelPlan, *, memory: tuple[float, ...] | None = None, headroom: float = 0.0) -> Estimate:
        """One fully specified plan (fitting or not)."""
        shape, table = self.shape, self.table(self.setup(c))
        holdings = self.holdings(c.schedule, c.pp, c.stages_per_rank)
        work = {h: table.rank(h) for h in holdings}
        busiest = max(holdings, key=lambda h: work[h].total)
        params = self._load(c, busiest)
        strides = self.traits.strides({"dp": c.dp, "pp": c.pp, "cp": c.cp, "mp": c.mp})
        step = step_time(c, self.cluster, self.traits, busiest=work[busiest],
                         rank_params=params.dense_params + params.expert_params, rank_dense_params=params.dense_params,
                         units=busiest.blocks + c.stages_per_rank, seq_len=shape.seq_len, d_model=shape.d_model,
                         strides=strides)
        memory = self.memory(c) if memory is None else memory
        limit = self.memory_limit(c, headroom)
        tokens = c.dp * c.microbatches * c.micro_batch_size * shape.seq_len
        seconds = step.seconds
        devices = c.world if self.cluster.is_gpu else min(
            c.world, self.cluster.topology.nodes_for(c.world) * self.cluster.device.units_per_node)
        model = self.model_flops * tokens / seconds / devices
        hardware = self.hardware_flops[c.ac == "full"] * tokens / seconds / devices
        fits = max(memory) <= limit
        reason = None if fits else (f"out of memory: needs {max(memory) / 2**30:.2f} GiB per rank, "
                                    f"has {limit / 2**30:.2f} GiB")
        sizes = self.split(c.pp * c.stages_per_rank, SCHEDULES[c.schedule].placement)
        return Estimate(c, fits, reason, seconds, tokens / seconds, model / self.cluster.device.peak(c.precision),
                        max(memory), limit, step.breakdown, step.terms, sizes, model / 1e12, hardware / 1e12, memory)


def price(shape: DecoderShape, candidate: ParallelPlan, *, cluster: Cluster,
          traits: EngineTraits = THIS_ENGINE) -> Estimate:
    """One fully specified plan (fitting or not)."""
    return Pricer(shape, cluster, traits).price(candidate)
