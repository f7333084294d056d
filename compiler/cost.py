"""Per-layer costs of the model at the micro-batch shape, used to place layers on pipeline stages
and by the planner.

For every layer group the tracer splits between (embedding, each block, final norm + LM head) we
run forward + backward once under ``FakeTensorMode`` (shapes only, no memory, no arithmetic) and
record:
- training FLOPs, counted by ``torch.utils.flop_counter.FlopCounterMode`` from the aten ops that
  really run (forward and backward);
- parameter bytes;
- activation bytes: what autograd saves for backward (``saved_tensors_hooks``), under the run's
  autocast dtype, excluding the weights themselves and their autocast copies; the head's include the
  logits, which the loss saves and the last pipeline stage keeps as its output from forward to backward
  (``head_loss_bytes``);
- selective bytes: what a block keeps under ``--activation-checkpointing selective``: its input and the
  outputs of the ops the policy saves (compiler/parallelize/activation_checkpointing.py ``SAVED_OPS``,
  recorded by a dispatch mode as the checkpoint's own caching mode sees them); other layers keep their
  activation bytes (only blocks are checkpointed). Recomputing such a block allocates what autograd saves
  less the kept outputs it saves too (``selective_recompute_bytes``);
- multi-token prediction's depths (models/common/mtp.py), which the last stage runs after its head: counted
  with the head (their blocks, projections, the head and loss again, the embedding's copy);
- transient bytes: what a layer's backward holds at once beyond that: the loss's gradient of the logits
  (in their dtype) and its fp32 working chunks (compiler/parallelize/cross_entropy.py). At GPT-2's
  vocabulary the loss sets the step's peak: on an H200, GPT-2 small (mbs 8, T 1024, bf16) peaked 4.7 GiB
  above the saved tensors alone with F.cross_entropy on fp32 logits (two fp32 gradients of their size).
With ``mp > 1`` a block is profiled as one tensor-parallel shard (H/mp heads, mlp_width/mp hidden
units) and the embedding and head as one vocabulary shard (ceil(V/mp) rows, the logits' V/mp columns;
the loss runs on the sharded logits), so FLOPs, parameters and activations are per rank. Blocks of one
kind have the same shape (a mixture's first dense blocks differ from its MoE blocks), so the first block of
each kind is profiled and its cost used for every block of that kind. A mixture-of-experts block counts
the FLOPs of the k experts each token visits (dropless: every assignment is computed) and all E experts'
parameters.

The measured-time alternative (forward + backward of each group timed on the real device) lives in
runtime/observe/layer_timing.py: measuring needs a device, counting does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from compiler.parallelize.activation_checkpointing import SAVED_OPS
from compiler.parallelize.cross_entropy import CPU_CHUNK_BYTES, chunk_rows, chunked_cross_entropy
from compiler.precisions import PRECISIONS
from compiler.torch_compat import CPU_FLASH_ATTENTION, FakeTensorMode, TorchDispatchMode, tensor_base
from models import BANDED_ATTENTION_FLOPS, GROUPED_MM_FLOPS, MTP, mtp_depth, spec_of
from models.spec import COLWISE, FINAL_NORM, HEADWISE, LM_HEAD, ROWWISE, TOKEN_EMBEDDING


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """QK^T and the scores times V, each 2 b h s_q s_k d over the h *query* heads (grouped-query attention's
    kernel shares the key/value heads, not these products): torch's formula, written here because torch 2.11's
    asserts equal head counts."""
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (d + d_v)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Five products (torch's sdpa_backward_flop_count): the scores recomputed, the gradients of the scores, of
    V, of Q and of K, over the query heads."""
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (3 * d + 2 * d_v)


# FlopCounterMode knows the CUDA attention kernels; teach it the CPU flash-attention kernel that
# F.scaled_dot_product_attention runs here (2 products forward, 5 backward), and the grouped matrix product of a
# mixture's experts (an opaque operator: models/common/grouped_mm.py gives its count, 2 M K N per call).
_FLOPS = {**dict(zip(CPU_FLASH_ATTENTION, (_cpu_attention, _cpu_attention_backward))), **GROUPED_MM_FLOPS,
          **BANDED_ATTENTION_FLOPS}


@dataclass(frozen=True)
class LayerCost:
    name: str
    flops: float  # forward + backward FLOPs for one micro-batch (per mp rank)
    params: int  # parameters held by one mp rank
    activation_bytes: int  # saved for backward, per micro-batch, per mp rank
    weight_copy_bytes: int = 0  # autocast's low-precision copies of the weights (cached per step)
    transient_bytes: int = 0  # held at once during its backward beyond activation_bytes, per micro-batch
    selective_activation_bytes: int = 0  # kept per micro-batch under selective checkpointing, per mp rank
    selective_recompute_bytes: int = 0  # allocated by its recomputation under selective checkpointing (blocks)
    seconds: float | None = None  # measured forward + backward time, in time mode


def layer_costs(cfg, *, micro_batch_size: int, precision: str = "fp32", mp: int = 1) -> list[LayerCost]:
    """Costs of [embedding, block 0, ..., block L-1, head], in model order, for any registered family. Blocks of
    one kind (``ModelSpec.block_kinds``: dense, or a mixture of experts; and ``attention_windows``: full or sliding
    attention) have the same shape: the first block of each kind is profiled and its cost used for every block of
    that kind. Counted once per process for each set of arguments (a pure function of them; every rank counts the
    split of each run it builds)."""
    try:
        hash(cfg)
    except TypeError:  # a config with a mutable field: counted every time
        return list(_counted_layer_costs.__wrapped__(cfg, micro_batch_size, precision, mp))
    return list(_counted_layer_costs(cfg, micro_batch_size, precision, mp))


@functools.lru_cache(maxsize=16)
def _counted_layer_costs(cfg, micro_batch_size: int, precision: str, mp: int) -> tuple[LayerCost, ...]:
    spec = spec_of(cfg)
    # A block's kind and its attention window (gpt-oss's sliding layers attend over W keys, the others over all).
    kinds = list(zip(spec.block_kinds(cfg), spec.attention_windows(cfg)))
    first_of_kind = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}  # kind -> its first block
    with FakeTensorMode():
        model = spec.build(replace(cfg, n_layers=max(first_of_kind.values(), default=0) + 1))
        for i in first_of_kind.values():
            model.layers[str(i)] = tensor_parallel_shard(model.layers[str(i)], spec.block_tp_plan, mp)
        vocabulary_parallel_shard(model, mp)
        forwards = {i: layer_group_forwards(model, seq_len=cfg.seq_len, micro_batch_size=micro_batch_size,
                                            device=torch.device("cpu"), block=str(i)) for i in first_of_kind.values()}
        groups = layer_group_modules(model)
        first = forwards[min(first_of_kind.values())]
        embed = _profile("embedding", first["embedding"], groups["embedding"], precision)
        block_input = micro_batch_size * cfg.seq_len * cfg.d_model * 4  # the fp32 residual stream, [b, t, d]
        blocks = {kind: _profile("block", forwards[i]["block"], [model.layers[str(i)]], precision,
                                 checkpointed_input_bytes=block_input)
                  for kind, i in first_of_kind.items()}
        head = _profile("head", first["head"], groups["head"], precision)
        depths = _mtp_cost(model, spec, mp=mp, seq_len=cfg.seq_len, micro_batch_size=micro_batch_size,
                           precision=precision) if mtp_depth(cfg) else None
    # The hooks saw the logits (the loss saves them): only the backward's transient is added.
    _, transient = head_loss_bytes(micro_batch_size * cfg.seq_len, vocab_rows=-(-cfg.vocab_size // mp),
                                   precision=precision)
    head = replace(head, transient_bytes=transient)
    if depths is not None:  # the last stage runs the MTP depths after the head: one layer of the split with it
        head = replace(head, flops=head.flops + depths.flops, params=head.params + depths.params,
                       activation_bytes=head.activation_bytes + depths.activation_bytes,
                       weight_copy_bytes=head.weight_copy_bytes + depths.weight_copy_bytes,
                       selective_activation_bytes=head.selective_activation_bytes + depths.activation_bytes)
    return (embed, *(replace(blocks[kind], name=f"layers.{i}") for i, kind in enumerate(kinds)), head)


def _mtp_cost(model: nn.Module, spec, *, mp: int, seq_len: int, micro_batch_size: int, precision: str) -> LayerCost:
    """Every MTP depth's forward and backward as the last stage's loss runs them (runtime/engine/mtp_loss.py): the
    embedding's copy, the depth's norms, projection and block, the head again and the loss, per TP shard."""
    mtp = getattr(model, MTP)
    for layer in mtp.layers.values():
        layer.set_submodule("block", tensor_parallel_shard(layer.block, spec.block_tp_plan, mp))
    if mp > 1:  # the embedding's copy: its vocabulary shard, as the embedding's
        mtp.set_submodule("embed", nn.Embedding(-(-mtp.embed.num_embeddings // mp), mtp.embed.embedding_dim))
    tokens = torch.randint(0, mtp.embed.num_embeddings, (micro_batch_size, seq_len))  # [b, t]
    future = torch.randint(0, mtp.embed.num_embeddings, (micro_batch_size, seq_len, len(mtp.layers)))  # [b, t, D]
    hidden = torch.randn(micro_batch_size, seq_len, mtp.embed.embedding_dim, requires_grad=True)  # [b, t, d]
    head = getattr(model, LM_HEAD)

    def forward():
        return sum(chunked_cross_entropy(logits.flatten(0, 1), tokens.flatten()) for logits in mtp(hidden, future, head))

    return _profile("mtp", forward, [mtp], precision)


def head_loss_bytes(tokens: int, *, vocab_rows: int, precision: str,
                    chunk_bytes: int = CPU_CHUNK_BYTES) -> tuple[int, int]:
    """(held, transient) bytes of the logits of ``tokens`` tokens over ``vocab_rows`` vocabulary rows: the last
    stage's output, kept from its forward to its backward in the compute dtype (compiler/parallelize/
    message_dtype.py) and saved by the loss; and during the loss's backward their gradient, in the same
    dtype, with two fp32 chunks of rows (one upcast chunk and its softmax; compiler/parallelize/
    cross_entropy.py; ``chunk_bytes`` as ``loss_chunk_bytes`` gives them for the device), where
    F.cross_entropy on fp32 logits held two fp32 gradients of the whole size."""
    itemsize = PRECISIONS[precision].dtype.itemsize
    logits = tokens * vocab_rows
    chunk = min(tokens, chunk_rows(vocab_rows, chunk_bytes=chunk_bytes)) * vocab_rows
    return logits * itemsize, logits * itemsize + (2 if itemsize < 4 else 1) * 4 * chunk


def layer_group_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The head group (the final norm and the head: what the last stage holds after its blocks) and the
    embedding group (every other top-level module but the blocks)."""
    ends = (FINAL_NORM, LM_HEAD)
    return {"embedding": [m for n, m in model.named_children() if n not in (*ends, "layers", MTP)],
            "head": [m for n, m in model.named_children() if n in ends]}


def layer_group_forwards(model: nn.Module, *, seq_len: int, micro_batch_size: int, device: torch.device,
                         block: str = "0") -> dict:
    """Forward of each layer group as its pipeline stage runs it (of the blocks, ``layers[block]``), returning
    what backward starts from.
    The head's includes the loss (the last stage computes it): at a large vocabulary the softmax over
    [micro-batch x seq, vocab] logits is a large share of the head's time but no matmul FLOPs."""
    table = getattr(model, TOKEN_EMBEDDING)
    tokens = torch.randint(0, table.num_embeddings, (micro_batch_size, seq_len), device=device)  # [b, t]
    hidden = torch.randn(micro_batch_size, seq_len, table.embedding_dim, device=device, requires_grad=True)  # [b, t, d]
    return {
        "embedding": lambda: model.embed(tokens),
        "block": lambda: model.layers[block](hidden),
        "head": lambda: chunked_cross_entropy(model.logits(hidden).flatten(0, 1), tokens.flatten()),
    }


def tensor_parallel_shard(block: nn.Module, plan: dict[str, str], mp: int) -> nn.Module:
    """The part of a block one of ``mp`` tensor-parallel ranks computes, following the family's plan:
    a column-parallel linear keeps 1/mp of its output features, a row-parallel one 1/mp of its inputs."""
    if mp == 1:
        return block
    held = dict(block.named_modules())
    for name, style in plan.items():
        if style == HEADWISE and name in held:  # per-head parameters (sinks): this rank's heads
            for key, param in list(held[name].named_parameters(recurse=False)):
                setattr(held[name], key, nn.Parameter(param.new_empty(param.shape[0] // mp, *param.shape[1:])))
            continue
        if style not in (COLWISE, ROWWISE) or name not in held:  # a plan may name another kind of block's modules
            continue
        linear = held[name]
        features = ((linear.in_features, linear.out_features // mp) if style == COLWISE
                    else (linear.in_features // mp, linear.out_features))
        block.set_submodule(name, nn.Linear(*features, bias=linear.bias is not None))
    return block


def vocabulary_parallel_shard(model: nn.Module, mp: int) -> None:
    """The rows of the token embedding and of the head one of ``mp`` ranks holds (the largest shard)."""
    if mp == 1:
        return
    table, head = getattr(model, TOKEN_EMBEDDING), getattr(model, LM_HEAD)
    rows = -(-table.num_embeddings // mp)
    setattr(model, TOKEN_EMBEDDING, nn.Embedding(rows, table.embedding_dim))
    setattr(model, LM_HEAD, nn.Linear(head.in_features, rows, bias=head.bias is not None))


def _profile(name: str, forward, modules: list[nn.Module], precision: str, *,
             checkpointed_input_bytes: int | None = None) -> LayerCost:
    """Counts of one layer group's forward and backward. ``checkpointed_input_bytes``: a block's input, which
    selective checkpointing keeps beside its saved ops' outputs (None: not checkpointed, it keeps what
    autograd saves)."""
    params = [p for m in modules for p in m.parameters()]
    param_ids = {id(p) for p in params}
    saved: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, is a weight or a copy of one)

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()  # views of one tensor (q, k, v of one qkv output) count once
        saved[storage._cdata] = (storage.nbytes(), _is_weight(t, param_ids))
        return t

    kept = _SavedOpOutputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False,
                                                                                      custom_mapping=_FLOPS) as counter:
        with PRECISIONS[precision].autocast("cpu"), kept:
            out = forward()
        out.float().sum().backward()
    activations = sum(n for n, weight in saved.values() if not weight)
    copies = sum(n for n, weight in saved.values() if weight) if PRECISIONS[precision].autocast_dtype else 0
    if checkpointed_input_bytes is None:
        selective, recompute = activations, 0
    else:
        selective = checkpointed_input_bytes + kept.bytes
        # The recomputed forward takes the kept outputs from the cache: where autograd saves them, no new memory.
        reused = sum(saved[key][0] for key in kept.storages if key in saved and not saved[key][1])
        recompute = activations - reused
    return LayerCost(name, float(counter.get_total_flops()), sum(p.numel() for p in params), activations, copies,
                     selective_activation_bytes=selective, selective_recompute_bytes=recompute)


class _SavedOpOutputs(TorchDispatchMode):
    """Bytes of the distinct storages the forward's ``SAVED_OPS`` return: what selective checkpointing's
    caching mode keeps (it caches every output of those ops, needed by backward or not)."""

    def __init__(self):
        super().__init__()
        # Kept alive, as the checkpoint's cache keeps them: a freed storage's address could be reused.
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.storages[storage._cdata] = storage
        return out

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())


_VIEW_OR_CAST = {"TBackward0", "ViewBackward0", "ToCopyBackward0", "PermuteBackward0", "TransposeBackward0",
                 "UnsafeViewBackward0", "ExpandBackward0"}


def _is_weight(t: torch.Tensor, param_ids: set[int]) -> bool:
    """A parameter, or a view / cast of one (autocast's cached weight copies, ``weight.t()``)."""
    base = tensor_base(t)
    if id(t) in param_ids or (base is not None and id(base) in param_ids):
        return True
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_OR_CAST:
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__ == "AccumulateGrad" and id(fn.variable) in param_ids

