"""The model on the meta device and its pipeline trace, memoized in the process.

Tracing (``torch.export`` under ``pipeline``) is most of the CPU time a rank spends building its stages. A process
that builds the same model again at the same micro-batch shape and split (the test harness trains many runs in one
process per mesh; the lab's probes rebuild engines) deep-copies the traced pair kept from the first build instead,
a small fraction of a trace. The copy is taken before any caller changes the modules, and every caller gets a copy
of its own: the stages' parallelization (LoRA, FP8, TP, FSDP) rewrites the modules in place.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import Pipe

from compiler.trace import trace_pipeline
from models import spec_of

_KEPT: OrderedDict[tuple, tuple[nn.Module, Pipe]] = OrderedDict()
_CAPACITY = 8  # meta-device pairs: their size is the graphs', not the weights'


def traced_model(cfg, *, micro_batch_size: int, local_seq_len: int, model_inputs: int, blocks_per_stage: list[int],
                 hidden_output: bool, before_trace: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, Pipe]:
    """(model, pipe): ``cfg``'s model built on the meta device (a tied head with a weight of its own) and traced at
    a (micro_batch_size, local_seq_len) micro-batch of ``model_inputs`` inputs (compiler/trace.py). ``before_trace``
    changes the model first (latent attention's CP gather, which holds a mesh): such a build is never kept."""
    key = (cfg, micro_batch_size, local_seq_len, model_inputs, tuple(blocks_per_stage), hidden_output)
    keep = before_trace is None and _hashable(key)
    if keep and key in _KEPT:
        _KEPT.move_to_end(key)
        return copy.deepcopy(_KEPT[key])
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        tokens = torch.zeros(micro_batch_size, local_seq_len, dtype=torch.long)  # (b, T/cp)
        example = (tokens, *(torch.zeros_like(tokens) for _ in range(model_inputs - 1))) if model_inputs > 1 else tokens
        if before_trace is not None:
            before_trace(model)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=blocks_per_stage,
                          hidden_output=hidden_output)
    if keep:
        _KEPT[key] = copy.deepcopy((model, pipe))
        if len(_KEPT) > _CAPACITY:
            _KEPT.popitem(last=False)
    return model, pipe


def _hashable(key: tuple) -> bool:
    try:
        hash(key)
    except TypeError:  # a config with a mutable field: traced every time
        return False
    return True
