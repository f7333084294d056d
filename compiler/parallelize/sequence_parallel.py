"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2.2) on top of Megatron's tensor parallelism, with Megatron-LM's stage boundaries.

Between the tensor-parallel regions (attention, MLP) a block's activations are the same on every mp rank:
the norms and the residual stream compute and store B x T x D values mp times over. Sequence parallelism
splits them along the sequence instead: each mp rank keeps T/mp positions of the residual stream and runs
the norms on them; attention and the MLP all-gather the sequence before their column-parallel matrices
("g") and their row-parallel matrices reduce-scatter over the sequence instead of all-reducing ("g-bar").
An all-reduce is a reduce-scatter plus an all-gather, so the communicated bytes are the same while the
norms' and residual's activations shrink mp-fold.

Here a family's plan names the pieces (models/spec.py): ``SEQUENCE_NORM`` (DTensor's ``SequenceParallel``:
the norm's input is a Shard(1) DTensor, its weight Replicate), ``GATHER_SEQUENCE`` (``GatherSequence``
below, on the attention and MLP modules), ``ROWWISE_SCATTER`` (``RowwiseParallel(output_layouts=Shard(1))``);
at the model's ends, the final norm runs on shards and the vocabulary-parallel head gathers the sequence
(``VOCAB_HEAD_FROM_SEQUENCE``: its input all-gathered, its gradient reduce-scattered).

The residual stream stays sharded from the embedding to the final norm, across stage boundaries too, as in
Megatron-LM: pipeline stages send and receive (B, T/mp, D) shards (``shard_stage_boundaries``), so a
boundary carries 1/mp of the bytes of a whole sequence and costs no collective. The sequence is split
where the embedding ends:
- when the token embedding's output is the residual stream itself (RoPE models: nothing is added to it), the
  vocabulary-parallel embedding reduce-scatters its partial sums over the sequence instead of all-reducing
  them (Megatron's ``reduce_scatter_embeddings``; backward: an all-gather);
- otherwise (learned positions are added to it) the embedding all-reduces as without SP and the stage keeps
  its own slice of the sum before the first block (a local slice; backward: an all-gather of the gradient),
  as Megatron's ``scatter_to_sequence_parallel_region`` after adding position embeddings.
None of these is inside a checkpointed block, so activation checkpointing never runs them again.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

SEQUENCE_DIM = 1  # hidden states are (B, T, D)


def _sequence_shards(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """(B, T/mp, D) local shard, or a DTensor of any placement -> a Shard(1) DTensor."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)


def _is_hidden_state(x) -> bool:
    # Traced modules do not keep the Python argument order (a block may take (positions, x)), so the hidden
    # states are told by their floating-point dtype, not their place; positions of packed documents are int64.
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _on_hidden_states(args: tuple, fn) -> tuple:
    """``fn`` applied to the hidden states among a module's inputs, the other inputs as they are."""
    return tuple(fn(a) if _is_hidden_state(a) else a for a in args)


class GatherSequence(ParallelStyle):
    """The module's hidden states arrive as sequence shards (B, T/mp, D) and are all-gathered to a Replicate
    DTensor (B, T, D) that its column-parallel linears consume directly: in backward their partial input
    gradients are summed as DTensors and reduce-scattered once, here. Other inputs (positions) pass as they are.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple):
            return _on_hidden_states(
                args, lambda x: _sequence_shards(x, device_mesh).redistribute(device_mesh, [Replicate()]))

        module.register_forward_pre_hook(gather)
        return module


def reduce_scatter_sequence(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """(B, T, D) partial sums on every mp rank -> this rank's (B, T/mp, D) shard of their sum (one
    reduce-scatter; backward: the gradient's shards all-gathered, since every rank's partial sum contributed
    to every position)."""
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(
        mesh, [Shard(SEQUENCE_DIM)]).to_local()


def keep_own_sequence_shard(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """(B, T, D), the same on every mp rank -> this rank's (B, T/mp, D) slice (no communication; backward:
    the gradient's slices all-gathered, the gradient of the whole sequence)."""
    return DTensor.from_local(whole, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(SEQUENCE_DIM)]).to_local()


def shard_stage_boundaries(stage_module: fx.GraphModule, mesh: DeviceMesh, *, embedding: str, head: str,
                           blocks: list[str], embedding_module: nn.Module | None) -> None:
    """Make the traced stage receive and send (B, T/mp, D) sequence shards, and split the sequence where the
    model's embedding ends if this stage holds it (see the module docstring).

    ``embedding``/``head``: the model's names of the token embedding and the LM head; ``blocks``: this stage's
    blocks in order; ``embedding_module``: the stage's vocabulary-parallel embedding, if it holds it (its
    ``scatter_sequence`` attribute switches it to a reduce-scatter). Torch's pipeline stage sizes its receive
    buffers, and checks what a stage sends, from the graph's example values (``node.meta["val"]``): those of
    the hidden states crossing a boundary are set to the shard's shape here."""
    mp = mesh.size()
    nodes = list(stage_module.graph.nodes)
    holds_head = head in dict(stage_module.named_modules())
    _shard_example_values([n for n in nodes if n.op == "placeholder"], mp)
    (output,) = [n for n in nodes if n.op == "output"]
    if not holds_head:
        _shard_example_values(list(output.all_input_nodes), mp)
        stage_module.register_forward_hook(lambda _m, _a, out: _local(out))
    else:  # the last stage sends nothing on; beside its logits it may return the hidden state (MTP), a shard
        _shard_example_values([n for n in output.all_input_nodes if not (n.op == "call_module" and n.target == head)], mp)
    if embedding_module is None:
        return
    if _feeds_blocks_directly(stage_module.graph, embedding):
        embedding_module.scatter_sequence = True
    elif blocks:
        stage_module.get_submodule(blocks[0]).register_forward_pre_hook(
            lambda _m, args: _on_hidden_states(args, lambda x: keep_own_sequence_shard(x, mesh)))
    else:  # the embedding alone on this stage: it sends its slice on
        stage_module.register_forward_hook(
            lambda _m, _a, out: _on_hidden_states(out, lambda x: keep_own_sequence_shard(x, mesh))
            if isinstance(out, tuple) else keep_own_sequence_shard(out, mesh))


def _feeds_blocks_directly(graph: fx.Graph, embedding: str) -> bool:
    """The embedding's output reaches the first block (or the stage's output) untouched: no op between them
    (nothing added to the token embeddings), so its partial sums may be reduce-scattered straight away."""
    (node,) = [n for n in graph.nodes if n.op == "call_module" and n.target == embedding]
    return all(user.op == "output" or (user.op == "call_module" and user.target.startswith("layers."))
               for user in node.users)


def _shard_example_values(nodes: list[fx.Node], mp: int) -> None:
    """The hidden states' example values (B, T, D) -> (B, T/mp, D)."""
    for node in nodes:
        value = node.meta.get("val")
        if _is_hidden_state(value) and value.ndim == 3:
            shape = (value.shape[0], value.shape[1] // mp, value.shape[2])
            node.meta["val"] = torch.empty(shape, dtype=value.dtype, device="meta")


def _local(out):
    """A stage's outputs as plain tensors (p2p sends local shards)."""
    if isinstance(out, DTensor):
        return out.to_local()
    if isinstance(out, tuple):
        return tuple(_local(o) for o in out)
    return out
