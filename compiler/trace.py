"""Trace a model once at the micro-batch shape and split it into pipeline stages at block boundaries.

``torch.distributed.pipelining.pipeline`` runs ``torch.export`` underneath, so the stage graphs are
specialised to the example micro-batch shape: a different micro-batch size needs a new trace.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator

import torch
from torch import nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipeline

from compiler.partition import split_points
from compiler.torch_compat import run_generated_code
from models.spec import EagerModule

# build_stage() warns once per restored nn.Linear / nn.Embedding that it skips rewriting devices in
# a non-graph module; that is expected after restore_linear_modules, not a problem.
logging.getLogger("torch.distributed.pipelining._IR").setLevel(logging.ERROR)


def trace_pipeline(model: nn.Module, *, example_microbatch: torch.Tensor | tuple[torch.Tensor, ...],
                   blocks_per_stage: list[int], hidden_output: bool = False) -> Pipe:
    """Split ``model`` into len(blocks_per_stage) stages; stage s holds blocks_per_stage[s] blocks.
    ``example_microbatch``: the model's input (tokens), or its inputs (tokens, positions) for packed
    documents; the positions then travel from stage to stage with the activations (models/spec.py run_blocks).
    ``hidden_output``: the last stage returns (logits, the hidden state before the final norm), what multi-token
    prediction starts from (runtime/engine/mtp_loss.py), instead of the logits.

    The embedding lands on stage 0 and the final norm + LM head on the last stage; either stage may
    hold no block (a split before block 0, or before the final norm).
    """
    n_blocks = sum(blocks_per_stage)
    # A split before block i; before the final norm when the last stage holds only the head.
    split_spec = {(f"layers.{i}" if i < n_blocks else "norm"): SplitPoint.BEGINNING
                  for i in split_points(blocks_per_stage)}
    args = example_microbatch if isinstance(example_microbatch, tuple) else (example_microbatch,)
    with traced_as_stand_ins(model), returning_hidden(model, hidden_output):
        pipe = pipeline(model, mb_args=args, split_spec=split_spec)
    if pipe.num_stages != len(blocks_per_stage):
        raise RuntimeError(f"tracer produced {pipe.num_stages} stages, expected {len(blocks_per_stage)}")
    for stage in range(pipe.num_stages):
        use_generated_code(pipe.get_stage_module(stage))
    return pipe


@contextlib.contextmanager
def traced_as_stand_ins(model: nn.Module) -> Iterator[None]:
    """While tracing, every ``EagerModule`` of ``model`` runs its ``trace_forward`` (models/spec.py), its tensor
    inputs first copied in the order of its signature: the copies tell ``restore_eager_modules`` which of the
    traced module's inputs is which."""
    eager = [m for m in model.modules() if isinstance(m, EagerModule)]
    for module in eager:
        # an instance attribute: nn.Module.__call__ finds it first
        module.forward = functools.partial(_with_marked_inputs, module.trace_forward)
    try:
        yield
    finally:
        for module in eager:
            del module.forward


@contextlib.contextmanager
def returning_hidden(model: nn.Module, enabled: bool) -> Iterator[None]:
    """While tracing (``enabled``), the model's forward returns (logits, hidden) (models/spec.py: ``hidden``, then
    ``logits``)."""
    if enabled:
        model.forward = functools.partial(_logits_and_hidden, model)  # an instance attribute: __call__ finds it first
    try:
        yield
    finally:
        if enabled:
            del model.forward


def _logits_and_hidden(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                       documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.hidden(tokens, positions, documents)  # (B, T, D)
    logits = model.logits(hidden)
    # A copy made after the final norm's split point: the last stage returns it, also when it holds no block (the
    # hidden state itself would be the previous stage's output, which the pipeline gives no loss function).
    return logits, hidden.clone()


def _with_marked_inputs(trace_forward, *args):
    return trace_forward(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))


def restore_eager_modules(stage_module: nn.Module, reference: nn.Module) -> list[str]:
    """Put ``reference``'s ``EagerModule``s back in place of their traced copies in the stage (the parent graph
    calls them by name; the tracer keeps the model's Parameter objects, so they are the stage's own). Returns
    their names.

    The tracer orders a traced module's inputs by where its graph first uses them, not as its signature does
    (attention's (q, k, v) may arrive as (k, q, v)): each restored module gets the parent's arguments back in
    its own order, read from the marks ``traced_as_stand_ins`` left."""
    held = dict(stage_module.named_modules())
    restored = []
    for name, module in reference.named_modules():
        if isinstance(module, EagerModule) and name in held and not any(name.startswith(r + ".") for r in restored):
            order = _signature_order(held[name])
            stage_module.set_submodule(name, module)
            take_arguments_in_order(module, order)
            restored.append(name)
    return restored


def take_arguments_in_order(module: nn.Module, order: list[int]) -> None:
    """``module`` (an eager module, or what replaces one) takes the traced parent's positional arguments, its own
    i-th being the parent's ``order[i]``-th (recorded as ``module.traced_argument_order``)."""
    module.traced_argument_order = order
    if order != sorted(order):
        module.register_forward_pre_hook(lambda _m, args: tuple(args[i] for i in order))


def _signature_order(traced: nn.Module) -> list[int]:
    """For each of the module's own inputs in signature order, its place among the traced module's inputs."""
    graph = getattr(traced, "graph", None)
    if graph is None:
        return []
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    first_copy = {}  # placeholder -> the graph position of the copy made of it first
    for position, node in enumerate(nodes):
        if node.op == "call_function" and "clone" in str(node.target) and node.args and node.args[0] in placeholders:
            first_copy.setdefault(node.args[0], position)
    if len(first_copy) != len(placeholders):
        raise RuntimeError(f"cannot tell the inputs of a traced {type(traced).__name__} apart: "
                           f"{len(placeholders)} inputs, {len(first_copy)} marked")
    return [placeholders.index(p) for p in sorted(first_copy, key=first_copy.get)]


def use_generated_code(stage_module: nn.Module) -> None:
    """Run traced submodules as generated Python, not through ``fx.Interpreter``.

    Unflattened submodules default to interpreting their graph node by node (for readable stack
    traces); the generated ``forward`` computes the same thing without ~30 us of Python per node.
    """
    run_generated_code(stage_module)
