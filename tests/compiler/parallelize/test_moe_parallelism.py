"""compiler/parallelize/expert_parallel.py on one process: ``apply_moe_parallelism`` wraps every MoE layer's
auxiliary loss in the engine's ``StepBalanceLoss``, whose step scale reaches the router's gradient, and changes
no name in the state dict. The loss under SP / CP / EP against one process: tests/launches/test_parity.py."""

from __future__ import annotations

import torch
from torch import nn

from compiler.parallelize.expert_parallel import MoeMeshes, StepBalanceLoss, apply_moe_parallelism
from models import BalanceLoss, MoE
from models.common.load_balance import sequence_balance_loss
from models.common.router import Routing

D, E = 8, 4
ONE_PROCESS = MoeMeshes(ep=None, experts=None, tokens=None, sequence=None, replicas=1)


def _layers(coefs: tuple[float, ...]) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({str(i): MoE(d_model=D, expert_width=6, n_experts=E, routing=Routing(top_k=2),
                                      aux_loss_coef=coef) for i, coef in enumerate(coefs)})


def test_every_auxiliary_loss_is_wrapped_and_no_name_changes():
    stage = _layers((0.5, 0.0, 0.25))
    names = list(stage.state_dict())
    apply_moe_parallelism(stage, ONE_PROCESS, sequence_parallel=False)
    assert list(stage.state_dict()) == names
    assert isinstance(stage["0"].balance, StepBalanceLoss) and isinstance(stage["0"].balance.loss, BalanceLoss)
    assert stage["1"].balance is None  # no loss, nothing to wrap
    assert stage["2"].balance.loss.coef == 0.25 and stage["2"].balance.grad_scale == 1.0


def test_the_wrappers_step_scale_reaches_the_router():
    stage = _layers((0.5,))
    moe = stage["0"]
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    gate = moe.router.gate.weight
    moe.eval()
    (plain,) = torch.autograd.grad(moe(x).square().sum(), gate)
    routes = moe.router(x.reshape(-1, D))
    (aux,) = torch.autograd.grad(sequence_balance_loss(routes.scores, routes.experts, batch=2), gate)
    moe.train()
    apply_moe_parallelism(stage, ONE_PROCESS, sequence_parallel=False)
    (alone,) = torch.autograd.grad(moe(x).square().sum(), gate)
    torch.testing.assert_close(alone, plain + 0.5 * aux, rtol=1e-5, atol=1e-6)  # scale 1 until the step sets it
    moe.balance.grad_scale = 0.25  # as runtime/engine/experts.py does before a step: S / m x cp
    (scaled,) = torch.autograd.grad(moe(x).square().sum(), gate)
    torch.testing.assert_close(scaled, plain + 0.5 * 0.25 * aux, rtol=1e-5, atol=1e-6)
