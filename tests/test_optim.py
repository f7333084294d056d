import math

import pytest
import torch

from runtime.engine.optim import build_optimizer, lr_multiplier


def test_warmup_then_cosine_to_a_tenth():
    mult = [lr_multiplier(s, warmup_steps=10, total_steps=110) for s in range(110)]
    assert mult[0] == pytest.approx(0.1) and mult[9] == pytest.approx(1.0)
    assert mult[10] == pytest.approx(1.0)
    assert mult[60] == pytest.approx(0.55)  # half-way through the decay
    assert all(a >= b for a, b in zip(mult[10:], mult[11:]))
    assert lr_multiplier(110, warmup_steps=10, total_steps=110) == pytest.approx(0.1)
    assert lr_multiplier(0, warmup_steps=0, total_steps=10) == pytest.approx(1.0)


def test_weight_decay_only_on_matrices():
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([w, b], lr=1.0, weight_decay=0.5)
    decays = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays == {id(w): 0.5, id(b): 0.0}
    assert not math.isnan(opt.defaults["lr"])
