"""compiler/fp8/modules.py: ``swap_linears`` on the engine's models keeps every parameter (names, shapes, the very
tensors), leaves the head, the embedding and the routers in high precision, and the swapped model trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiler.fp8 import RECIPES, AmaxGuard, Float8Linear, keep_high_precision, swap_linears
from models import build_model, named_config


def tiny_gpt2():
    return build_model(named_config("tiny", n_layers=2), seed=0)


def moe_model():
    return build_model(named_config("qwen3-moe-debug"), seed=0)


def linears(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("build", [tiny_gpt2, moe_model])
def test_swapping_keeps_every_parameter_and_skips_head_embedding_and_routers(build):
    model = build()
    before = {name: p for name, p in model.state_dict(keep_vars=True).items()}
    swap_linears(model, RECIPES["rowwise"])
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[name] is before[name] for name in before)  # the same Parameters: optimizers, TP plans, FSDP
    kinds = linears(model)
    kept = {name for name, kind in kinds.items() if kind is nn.Linear}
    assert kept == {name for name in kinds if name == "head" or ".router." in name}
    assert kept and all(kind is Float8Linear for name, kind in kinds.items() if name not in kept)


def test_the_default_filter_reads_the_naming_contract():
    linear = nn.Linear(2, 2)
    assert keep_high_precision("head", linear) and keep_high_precision("layers.3.moe.router.gate", linear)
    assert not keep_high_precision("layers.0.mlp.gate", linear)  # a SwiGLU's gate projection is not a router
    assert not keep_high_precision("layers.0.attention.o", linear)


def test_a_custom_filter_decides_and_a_bare_linear_is_replaced():
    model = tiny_gpt2()
    swap_linears(model, RECIPES["tensorwise"], skip=lambda name, m: not name.endswith(".up"))
    assert {name for name, kind in linears(model).items() if kind is Float8Linear} == {"layers.0.mlp.up", "layers.1.mlp.up"}
    single = nn.Linear(4, 3)
    swapped = swap_linears(single, RECIPES["tensorwise"])
    assert isinstance(swapped, Float8Linear) and swapped.weight is single.weight and swapped.bias is single.bias


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_swapped_model_trains(name):
    torch.manual_seed(0)
    model = tiny_gpt2()
    guard = AmaxGuard()
    swap_linears(model, RECIPES[name], guard=guard)
    tokens = torch.randint(0, 256, (4, 33))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert guard.take().item() == 0.0
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_swapped_linear_stays_close_to_the_original():
    model = tiny_gpt2()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens)
        swap_linears(model, RECIPES["blockwise"])
        fp8 = model(tokens)
    assert not torch.equal(fp8, reference)
    assert ((fp8 - reference).abs().max() / reference.abs().max()).item() < 0.05
