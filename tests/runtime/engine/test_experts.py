"""runtime/engine/experts.py's ``ExpertBalance`` on one process: before a step it gives the engine's wrapper of
each MoE layer's auxiliary loss (never the model) the step's gradient scale, S / m x cp, and it refuses a layer
whose loss the engine did not wrap (whose gradient would silently keep scale 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compiler.parallelize.expert_parallel import MoeMeshes, apply_moe_parallelism
from models import MoE
from models.common.router import Routing
from runtime.engine.experts import ExpertBalance

ONE_PROCESS = MoeMeshes(ep=None, experts=None, tokens=None, sequence=None, replicas=1)


def _stage() -> nn.ModuleDict:
    return nn.ModuleDict({"0": MoE(d_model=8, expert_width=6, n_experts=4, routing=Routing(top_k=2), aux_loss_coef=0.5),
                          "1": MoE(d_model=8, expert_width=6, n_experts=4, routing=Routing(top_k=2))})


def _balance(stage: nn.Module, *, context_parallel: int = 1) -> ExpertBalance:
    return ExpertBalance.of(stage.named_modules(), moe_layer_names=["0", "1"], token_group=None, reports=False,
                            bias_rate=0.0, device=torch.device("cpu"), context_parallel=context_parallel)


def test_before_a_step_the_engines_wrapper_takes_the_scale():
    stage = _stage()
    apply_moe_parallelism(stage, ONE_PROCESS, sequence_parallel=False)
    balance = _balance(stage, context_parallel=2)
    balance.before_step(loss_scale=1024.0, microbatches=8)
    assert stage["0"].balance.grad_scale == 1024.0 / 8 * 2
    assert balance.balances == [stage["0"].balance]  # the layer without a loss has nothing to scale


def test_a_loss_the_engine_did_not_wrap_is_refused():
    with pytest.raises(TypeError, match="0's auxiliary loss is not the engine's"):
        _balance(_stage())
