"""Tensor parallelism on traced pipeline stages: put real ``nn.Linear`` modules back, then apply a plan.

The pipelining tracer turns every submodule into an ``InterpreterModule`` whose graph calls
``aten.linear`` on a ``weight`` attribute. DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` only
accept ``nn.Linear`` and ``nn.Embedding``, so we first swap in real modules that hold the very same
Parameter objects; the parent graph calls its children by name, so the swap is invisible to it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from compiler.parallelize.headwise import HeadwiseParallel
from compiler.parallelize.lora import with_adapters
from compiler.parallelize.replicated_modules import ReplicatedLinear, SumGradientOverHeads
from compiler.parallelize.sequence_parallel import GatherSequence, shard_stage_boundaries
from compiler.parallelize.vocab_parallel import VocabParallelEmbedding
from models import MTP_EMBEDDING, mtp_block_names
from models.spec import (
    COLWISE,
    GATHER_SEQUENCE,
    HEAD_NORM,
    HEAD_SHARED,
    HEADWISE,
    LM_HEAD,
    REPLICATED,
    ROWWISE,
    ROWWISE_SCATTER,
    SEQUENCE_LINEAR,
    SEQUENCE_NORM,
    TOKEN_EMBEDDING,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    VOCAB_HEAD_FROM_SEQUENCE,
)

_STYLES = {
    COLWISE: ColwiseParallel,
    ROWWISE: RowwiseParallel,
    VOCAB_EMBEDDING: VocabParallelEmbedding,  # the table's rows (the vocabulary) sharded, token ids replicated
    # Logits [B, T, V/mp] stay sharded on the vocabulary: the loss is vocabulary-parallel.
    VOCAB_HEAD: lambda: ColwiseParallel(output_layouts=Shard(-1)),
    # Sequence parallelism (compiler/parallelize/sequence_parallel.py): a norm on (B, T/mp, D) shards, the
    # sequence gathered at the attention's / MLP's input, the row-parallel output reduce-scattered.
    SEQUENCE_NORM: SequenceParallel,
    GATHER_SEQUENCE: GatherSequence,
    ROWWISE_SCATTER: lambda: RowwiseParallel(output_layouts=Shard(1)),
    # A norm over each head's features, its input (B, T, H/mp, hd) sharded by heads: DTensor's SequenceParallel
    # on the heads' dimension keeps the weight Replicate and sums its gradient over the ranks' heads.
    HEAD_NORM: lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    # Multi-head latent attention's replicated parts (compiler/parallelize/replicated_modules.py): the RoPE key every
    # head shares sums its gradient over mp; its down projections take the gathered sequence under SP.
    HEAD_SHARED: SumGradientOverHeads,
    REPLICATED: ReplicatedLinear,
    # gpt-oss's sinks (compiler/parallelize/headwise.py): one value per head, split with the heads.
    HEADWISE: HeadwiseParallel,
    # The head after a sequence-parallel final norm: all-gather the sequence (backward: reduce-scatter).
    VOCAB_HEAD_FROM_SEQUENCE: lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
    # A replicated linear on sequence shards (the MTP depths' projection): DTensor's SequenceParallel keeps the weight
    # Replicate and leaves its gradient a partial sum over mp; the output a local (B, T/mp, D) shard.
    SEQUENCE_LINEAR: lambda: SequenceParallel(use_local_output=True),
}
_HEAD_STYLES = (VOCAB_HEAD, VOCAB_HEAD_FROM_SEQUENCE)

# FSDP2 warns when a module it wraps returns a view ("... returned a view tensor. An in-place op on this view
# ... can cause backward to fail or produce wrong gradients"): an in-place op on the view would drop the
# pre-backward hook FSDP registers on it. The last stage returns one whenever mp > 1: the vocabulary-parallel
# head's logits leave DTensor through ``to_local``, which returns ``local.view_as(local)`` (a fresh tensor
# object for autograd's metadata). Nothing writes them in place: the schedule hands them to the loss
# function, and ours only read them (tests/launches/test_tensor_parallel.py checks that, and the ZeRO-3 parity case
# on 2x2x2, which must re-gather the head for backward through that hook, checks that it fires). So this
# exact warning, from FSDP's module, about our traced stage modules, says nothing here: it is silenced once
# the head is sharded, and any other view warning still shows.
_HEAD_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPGraphModule\) returned a view tensor"
_FSDP_STATE_MODULE = r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state"


def quiet_head_view_warning() -> None:
    warnings.filterwarnings("ignore", message=_HEAD_VIEW_WARNING, category=UserWarning, module=_FSDP_STATE_MODULE)


def restore_linear_modules(stage_module: nn.Module, reference: nn.Module) -> list[str]:
    """Replace traced stand-ins of ``nn.Linear`` / ``nn.Embedding`` by real modules; return their names."""
    restored = []
    stage_names = dict(stage_module.named_modules())
    for name, original in reference.named_modules():
        traced = stage_names.get(name)
        if traced is None or type(traced) is type(original):
            continue
        if isinstance(original, nn.Linear):
            real = _linear_like(traced, original)
        elif isinstance(original, nn.Embedding):
            real = _embedding_like(traced, original)
        else:
            continue
        stage_module.set_submodule(name, real)
        restored.append(name)
    return restored


def _linear_like(traced: nn.Module, original: nn.Linear) -> nn.Linear:
    real = nn.Linear(original.in_features, original.out_features, bias=original.bias is not None, device="meta")
    real.weight = traced.weight
    if original.bias is not None:
        real.bias = traced.bias
    return real


def _embedding_like(traced: nn.Module, original: nn.Embedding) -> nn.Embedding:
    real = nn.Embedding(original.num_embeddings, original.embedding_dim, device="meta")
    real.weight = traced.weight
    return real


def block_names(stage_module: nn.Module) -> list[str]:
    """Names of the transformer blocks ("layers.<i>") that live in this stage, in order, then the MTP depths' blocks
    ("mtp.layers.<k>.block") of a last stage: what the block plan, checkpointing, compiling and FSDP units take."""
    layers = getattr(stage_module, "layers", None)
    names = [f"layers.{key}" for key in sorted((k for k, _ in layers.named_children()), key=int)] if layers is not None else []
    return names + mtp_block_names(stage_module)


def apply_tp(stage_module: nn.Module, mp_mesh: DeviceMesh, *, block_plan: dict[str, str],
             model_plan: dict[str, str] | None = None, sequence_parallel: bool = False) -> nn.Module:
    """Shard every block of the stage over ``mp_mesh`` following ``block_plan``, and the model-level parts
    of ``model_plan`` the stage holds (the vocabulary-parallel embedding and head), Megatron layout.
    ``sequence_parallel``: both plans include the sequence-parallel entries, and the stage receives and sends
    (B, T/mp, D) sequence shards (compiler/parallelize/sequence_parallel.py)."""
    held = dict(stage_module.named_modules())
    # A family with blocks of two kinds (dense and mixture-of-experts) names both kinds' modules in one plan:
    # each block takes the entries it has.
    # A LoRA-adapted linear (compiler/parallelize/lora.py) takes its plan's style with its adapters sharded alike.
    plan = {
        f"{block}.{key}": with_adapters(_STYLES[style](), held[f"{block}.{key}"])
        for block in block_names(stage_module)
        for key, style in block_plan.items() if f"{block}.{key}" in held
    }
    plan.update({key: _STYLES[style]() for key, style in (model_plan or {}).items() if key in held})
    heads = [key for key in plan if (model_plan or {}).get(key) in _HEAD_STYLES]
    if heads:
        quiet_head_view_warning()
    if plan:
        parallelize_module(stage_module, mp_mesh, plan)
    for key in heads:
        _trace_local_logits(stage_module, held[key])
    if sequence_parallel:
        shard_stage_boundaries(stage_module, mp_mesh, embedding=TOKEN_EMBEDDING, head=LM_HEAD,
                               blocks=block_names(stage_module), embedding_module=held.get(TOKEN_EMBEDDING))
        if MTP_EMBEDDING in held:  # the MTP depths run on sequence shards as the blocks do
            held[MTP_EMBEDDING].scatter_sequence = True
    return stage_module


def _trace_local_logits(stage_module: nn.Module, head: nn.Module) -> None:
    """Make the traced output values say what the vocabulary-parallel head leaves: this rank's [b, T, V_r]
    logits, not the [b, T, V] of the trace (torch 2.11 checks every stage's outputs against them)."""
    full, rows = head.weight.shape[0], head.weight.to_local().shape[0]
    (output,) = [n for n in stage_module.graph.nodes if n.op == "output"]
    for node in output.all_input_nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.ndim == 3 and value.shape[-1] == full:
            node.meta["val"] = torch.empty(*value.shape[:-1], rows, dtype=value.dtype, device="meta")
