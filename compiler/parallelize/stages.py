"""Build this rank's pipeline stages: on the meta device, trace, keep the local stages, then
LoRA -> FP8 -> CP -> TP -> AC -> data parallelism -> real storage for the local shards -> PipelineStage. (Under CP,
latent attention's latent gather is put in before tracing: compiler/parallelize/latent_gather.py.)

The order is a checklist (as in torchtitan's ``parallelize_*``): tensor parallelism must see real
``nn.Linear`` modules, activation checkpointing wraps the sharded blocks, data parallelism shards last,
over whatever parameters (plain or already TP-sharded DTensors) the stage then holds. Nothing has
storage until ``materialize``, which allocates only this rank's shards: start-up memory is the rank's
share of the model, not the whole model on every rank. A model with multi-token-prediction depths
(models/common/mtp.py) is traced returning its hidden state too, and its last stage holds the untraced ``mtp``
module, which every step of the checklist treats as the stage's own (its blocks take the block plan, AC and FSDP
units as the stage's blocks do); with two depths or more that stage's backward is never split into input and weight
passes (compiler/torch_compat.py ``backward_whole_in_input_pass``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from compiler.context_gather import LATENT, context_gather_of
from compiler.lora import LoraConfig
from compiler.parallelize.activation_checkpointing import maybe_apply_ac, original_name
from compiler.parallelize.compile import apply_compile
from compiler.parallelize.context_parallel import ContextParallelAttention
from compiler.parallelize.data_parallel import DataParallelOptions, apply_data_parallel, moe_gradient_factors
from compiler.parallelize.expert_parallel import MoeMeshes, apply_moe_parallelism, moe_modules
from compiler.parallelize.float8 import Fp8Options, expert_parallel_compute, maybe_apply_fp8, maybe_apply_fp8_all_gather
from compiler.parallelize.latent_gather import apply_latent_gather, cores_with_whole_keys
from compiler.parallelize.lora import apply_lora, freeze_base
from compiler.parallelize.materialize import materialize
from compiler.parallelize.message_dtype import apply_message_dtype
from compiler.parallelize.tensor_parallel import apply_tp, restore_linear_modules
from compiler.torch_compat import backward_whole_in_input_pass
from compiler.trace import restore_eager_modules
from compiler.traced_model import traced_model
from models import MTP, GroupedExperts, mtp_depth, mtp_model_plan, spec_of, tied_weights


@dataclass
class LocalStages:
    indices: list[int]  # global stage indices held by this rank, ascending
    modules: list[nn.Module]
    stages: list[PipelineStage]
    num_stages: int
    gradient_factors: dict[int, float] = field(default_factory=dict)  # id(param) -> factor after the reduction

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names ("layers.3.attn.qkv.weight"); a weight a stage
        shares between the embedding and the head is listed under both names."""
        return [(original_name(n), p) for m in self.modules for n, p in m.named_parameters(remove_duplicate=False)]


@dataclass(frozen=True)
class StageMeshes:
    pp: DeviceMesh
    mp: DeviceMesh
    fsdp: DeviceMesh | None  # 1-D (FSDP), 2-D (replicate, shard: HSDP), or None: nothing sharded
    moe: MoeMeshes | None = None  # a mixture-of-experts model's layers: expert parallelism and their FSDP units


def build_local_stages(
    cfg,
    *,
    blocks_per_stage: list[int],
    stage_indices: list[int],
    micro_batch_size: int,
    meshes: StageMeshes,
    device: torch.device,
    activation_checkpointing: str,
    data_parallel: DataParallelOptions,
    initial_value: Callable[[str, tuple[int, ...]], torch.Tensor],
    compile_blocks: bool = False,
    sequence_parallel: bool = False,
    model_inputs: int = 1,
    context_parallel: DeviceMesh | None = None,
    message_dtype: torch.dtype | None = None,
    lora: LoraConfig | None = None,
    fp8: Fp8Options | None = None,
    cp_gather: str = "auto",
) -> LocalStages:
    """This rank's stages ``stage_indices`` (its schedule's placement, compiler/schedules.py) of ``cfg``'s
    model cut into len(blocks_per_stage) stages, each tensor-parallel over the mp mesh (blocks, and the
    embedding and head over the vocabulary; the norms over the sequence with ``sequence_parallel``),
    checkpointed (``activation_checkpointing``: "none", "full" or "selective"), compiled (``compile_blocks``),
    data-parallel, and filled from ``initial_value(model name, full shape)``. ``model_inputs``: the model takes
    tokens (1), with positions (2: a context-parallel slice of each sequence), and document ids (3: packed
    documents; runtime/engine/data/inputs.py). ``context_parallel``: the cp mesh; each rank holds 1/cp of every
    sequence and attention gathers keys and values over it, or latent attention its latent as ``cp_gather`` says
    (the plan's: auto = where that is fewer values; compiler/context_gather.py). Activations and their gradients
    cross stages in ``message_dtype`` (the autocast dtype; None: fp32, the traced dtype). ``lora``: LoRA adapters on the targeted
    modules, everything else frozen (compiler/parallelize/lora.py). ``fp8``: the linear and expert products
    in FP8 (compiler/parallelize/float8.py), swapped in before TP. With MTP depths the last stage returns
    (logits, hidden state) and holds ``mtp`` (runtime/engine/mtp_loss.py runs it)."""
    n_stages = len(blocks_per_stage)
    indices = sorted(stage_indices)
    spec = spec_of(cfg)
    tied = tied_weights(cfg)
    cp = context_parallel.size() if context_parallel is not None else 1
    gathers = context_gather_of(cfg, mp=meshes.mp.size(), fp8=fp8 is not None, choice=cp_gather).gathers
    latent_gather = None
    if context_parallel is not None and gathers == LATENT:  # before tracing: the graph takes the gathered lengths
        def latent_gather(model: nn.Module) -> None:
            apply_latent_gather(model, context_parallel)
    depth = mtp_depth(cfg)
    # A tied head (and the MTP depths' embedding) gets a weight of its own: the copies may live on other stages.
    model, pipe = traced_model(cfg, micro_batch_size=micro_batch_size, local_seq_len=cfg.seq_len // cp,
                               model_inputs=model_inputs, blocks_per_stage=blocks_per_stage, hidden_output=depth > 0,
                               before_trace=latent_gather)
    model_plan = {**spec.model_plan(sequence_parallel=sequence_parallel),
                  **mtp_model_plan(depth, sequence_parallel=sequence_parallel)}
    modules, stages, factors = [], [], {}
    for index in indices:
        module = pipe.get_stage_module(index)
        if depth and index == n_stages - 1:
            # The MTP depths run in the last stage's loss function (runtime/engine/mtp_loss.py), outside its graph:
            # held here, every step below treats them as the stage's own modules.
            module.add_module(MTP, getattr(model, MTP))
        restore_eager_modules(module, model)
        restore_linear_modules(module, model)
        if lora is not None:
            apply_lora(module, lora)
        sequence = meshes.moe.sequence if meshes.moe is not None else None
        maybe_apply_fp8(module, fp8, context_parallel=context_parallel, sequence=sequence)
        if context_parallel is not None:
            ContextParallelAttention.apply(module, context_parallel, whole_keys=cores_with_whole_keys(module))
        if meshes.mp.size() > 1:
            apply_tp(module, meshes.mp, block_plan=spec.block_plan(sequence_parallel=sequence_parallel),
                     model_plan=model_plan, sequence_parallel=sequence_parallel)
        if meshes.moe is not None:
            # FP8 computes SwiGLU experts (GroupedExperts); others (gpt-oss's) keep the run's precision
            fp8_experts = fp8 and all(type(m.experts) is GroupedExperts for m in moe_modules(module))
            experts = (dict(local_compute=expert_parallel_compute(fp8, sequence=sequence), by_source=True)
                       if fp8_experts else {})
            apply_moe_parallelism(module, meshes.moe, sequence_parallel=sequence_parallel and meshes.mp.size() > 1,
                                  **experts)
        if lora is not None:
            freeze_base(module)  # TP's styles give the parameters they distribute requires_grad=True
        share_tied_weights(module, tied)
        maybe_apply_ac(module, activation_checkpointing, preserve_rng_state=lora is not None and lora.dropout > 0)
        if compile_blocks:
            apply_compile(module)
        if meshes.fsdp is not None or meshes.moe is not None:
            maybe_apply_fp8_all_gather(module, fp8)
            apply_data_parallel(module, meshes.fsdp, data_parallel, moe=meshes.moe)
        materialize(module, device=device, initial_value=initial_value)
        if meshes.moe is not None:
            factors.update(moe_gradient_factors(module, meshes.moe))
        # to_empty gives every module a Parameter of its own; point the head at the embedding's (the one
        # FSDP keeps and re-points both modules to around each forward) again.
        share_tied_weights(module, tied)
        fsdp_dtype = data_parallel.param_dtype if meshes.fsdp is not None else None
        if message_dtype is not None or fsdp_dtype is not None:  # else every stage computes and sends fp32
            apply_message_dtype(module, message_dtype or torch.float32, compute=fsdp_dtype or torch.float32,
                                receives=index > 0)
        modules.append(module)
        stage = pipe.build_stage(index, device, meshes.pp.get_group())
        if depth > 1 and index == n_stages - 1:
            # Split-backward schedules: torch's weight pass takes one ``autograd.grad`` per group of parameters,
            # and the depths' shared embedding's group runs back through depth 1's block, whose graph the earlier
            # groups have freed. This stage's input pass does its whole backward instead (its W is empty).
            backward_whole_in_input_pass(stage)
        stages.append(stage)
    return LocalStages(indices, modules, stages, n_stages, factors)


def share_tied_weights(stage_module: nn.Module, tied_weights: dict[str, str]) -> None:
    """A stage holding both the embedding and the head (one pipeline stage) uses one Parameter for both,
    as the tied model does: one weight, one gradient. Applied after TP, which shards both alike (vocabulary
    rows), and before FSDP, which then manages the one shared weight."""
    held = dict(stage_module.named_modules())
    for copy, source in tied_weights.items():
        copy_module, _, copy_attr = copy.rpartition(".")
        source_module, _, source_attr = source.rpartition(".")
        if copy_module in held and source_module in held:
            setattr(held[copy_module], copy_attr, getattr(held[source_module], source_attr))
