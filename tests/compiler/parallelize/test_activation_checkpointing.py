"""Activation checkpointing of traced stages: full and selective give the gradients of no checkpointing;
selective recomputes no matrix product (its backward counts the FLOPs of no checkpointing, full's one more
forward of every block's products), also when the backward runs twice through a block (split backward)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from compiler.parallelize.activation_checkpointing import apply_ac, maybe_apply_ac, original_name
from compiler.parallelize.tensor_parallel import block_names, restore_linear_modules
from compiler.trace import trace_pipeline
from models import build_model, named_config

CFG = named_config("tiny", n_layers=2, d_model=32, n_heads=2, mlp_width=64, seq_len=16, tie_embeddings=False)


def _stage(mode: str):
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    model = build_model(CFG, seed=3)
    stage = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[CFG.n_layers]).get_stage_module(0)
    restore_linear_modules(stage, model)
    return maybe_apply_ac(stage, mode), tokens


def _gradients_and_flops(mode: str) -> tuple[dict[str, torch.Tensor], float, float]:
    stage, tokens = _stage(mode)
    with FlopCounterMode(display=False) as forward:
        out = stage(tokens)
    with FlopCounterMode(display=False) as backward:
        out.float().square().mean().backward()
    grads = {original_name(n): p.grad for n, p in stage.named_parameters()}
    return grads, forward.get_total_flops(), backward.get_total_flops()


def test_selective_and_full_give_the_same_gradients_and_selective_recomputes_no_product():
    plain, plain_fwd, plain_bwd = _gradients_and_flops("none")
    for mode in ("full", "selective"):
        grads, fwd, bwd = _gradients_and_flops(mode)
        assert set(grads) == set(plain)
        for name, grad in plain.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{mode} {name}: {m}")
        assert fwd == plain_fwd
        if mode == "selective":
            assert bwd == plain_bwd, f"selective checkpointing recomputed {bwd - plain_bwd:.0f} FLOPs of products"
        else:
            assert bwd > plain_bwd  # the blocks' products run again


def _split_backward_gradients(mode: str) -> list[torch.Tensor]:
    """Input gradients first with the graph kept, then weight gradients in a second autograd call, as the
    split-backward schedules (zero-bubble, zbv, dualpipev) do; each call recomputes checkpointed blocks."""
    stage, _ = _stage(mode)
    blocks = [stage.get_submodule(n) for n in block_names(stage)]
    hidden = torch.randn(2, CFG.seq_len, CFG.d_model, generator=torch.Generator().manual_seed(1),
                         requires_grad=True)  # [b, t, d]: what a stage of blocks receives
    out = hidden
    for block in blocks:
        out = block(out)
    loss = out.float().square().mean()
    (input_grad,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    return [input_grad, *torch.autograd.grad(loss, [p for b in blocks for p in b.parameters()])]


def test_selective_serves_the_cached_products_to_a_second_backward_through_the_same_blocks():
    plain = _split_backward_gradients("none")
    for got, want in zip(_split_backward_gradients("selective"), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_apply_ac_refuses_an_unknown_mode():
    stage, _ = _stage("none")
    with pytest.raises(ValueError, match="full or selective"):
        apply_ac(stage, mode="partial")
