"""Traced and split stages, chained, compute exactly what the original model computes."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from compiler.parallelize.tensor_parallel import restore_linear_modules
from compiler.trace import restore_eager_modules, trace_pipeline
from models import build_model, named_config
from models.spec import EagerModule

# The engine traces a tied model with a weight for each end (they may land on different stages):
# the split itself is what is tested here.
UNTIED_TINY = dataclasses.replace(named_config("tiny"), tie_embeddings=False)


def _chain(stages, tokens):
    x = tokens
    for stage in stages:
        x = stage(x)
    return x


def test_chained_stages_match_forward_and_backward():
    cfg = UNTIED_TINY
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=3)
    reference = build_model(cfg, seed=3)
    pipe = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[1, 2, 1])
    stages = [pipe.get_stage_module(i) for i in range(3)]
    for stage in stages:
        restore_linear_modules(stage, model)

    names = [[n for n, _ in s.named_parameters()] for s in stages]
    # the embeddings open the pipeline and the head closes it (pos_emb is read as a slice of its weight,
    # so the traced stage lists it after the first block's parameters)
    assert {"tok_emb.weight", "pos_emb.weight"} <= set(names[0]) and names[2][-1] == "head.weight"
    assert sorted(n for ns in names for n in ns) == sorted(n for n, _ in reference.named_parameters())

    got, want = _chain(stages, tokens), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    weights = torch.randn_like(want)  # a non-trivial upstream gradient
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    ref_grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_embedding_and_head_can_be_stages_of_their_own():
    cfg = UNTIED_TINY
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    model, reference = build_model(cfg, seed=5), build_model(cfg, seed=5)
    pipe = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[0, 4, 0])
    stages = [pipe.get_stage_module(i) for i in range(3)]
    for stage in stages:
        restore_linear_modules(stage, model)
    names = [sorted(n for n, _ in s.named_parameters()) for s in stages]
    assert names[0] == ["pos_emb.weight", "tok_emb.weight"]
    assert names[2] == ["head.weight", "norm.bias", "norm.weight"]
    torch.testing.assert_close(_chain(stages, tokens), reference(tokens), rtol=0, atol=1e-6)


def test_restored_modules_are_real_linears_sharing_parameters():
    cfg = UNTIED_TINY
    model = build_model(cfg, seed=0)
    pipe = trace_pipeline(model, example_microbatch=torch.zeros(1, cfg.seq_len, dtype=torch.long),
                          blocks_per_stage=[2, 2])
    stage = pipe.get_stage_module(1)
    before = {n: p for n, p in stage.named_parameters()}
    restored = restore_linear_modules(stage, model)
    assert "layers.2.attn.qkv" in restored and "head" in restored
    assert isinstance(stage.get_submodule("layers.3.mlp.down"), nn.Linear)
    assert all(p is before[n] for n, p in stage.named_parameters())


def test_graph_keeps_head_count_symbolic():
    """view(B, T, -1, hd): the traced graph must not bake in n_heads, or TP shards could not run it."""
    cfg = UNTIED_TINY
    model = build_model(cfg, seed=0)
    pipe = trace_pipeline(model, example_microbatch=torch.zeros(2, cfg.seq_len, dtype=torch.long),
                          blocks_per_stage=[4])
    attention_graph = str(pipe.get_stage_module(0).get_submodule("layers.0.attn").graph)
    assert f"[2, {cfg.seq_len}, -1, 3, {cfg.head_dim}]" in attention_graph
    assert f"[2, {cfg.seq_len}, {cfg.n_heads}, 3, {cfg.head_dim}]" not in attention_graph


class _PerRowScale(EagerModule):
    """A data-dependent loop with a side effect: the tracer cannot keep either, so it traces the stand-in."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.stack([row * self.weight * (1 + int(row.abs().sum() > 1.0)) for row in x])

    def trace_forward(self, x):
        return x * self.weight


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), _PerRowScale()) for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_eager_modules_are_traced_as_stand_ins_and_run_for_real_in_the_stages():
    model = _Toy()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    pipe = trace_pipeline(model, example_microbatch=x, blocks_per_stage=[1, 1])
    stages = [pipe.get_stage_module(i) for i in range(2)]
    assert [restore_eager_modules(s, model) for s in stages] == [["layers.0.1"], ["layers.1.1"]]
    assert all(not isinstance(m, EagerModule) or "forward" not in vars(m) for m in model.modules())  # stand-ins gone
    got = _chain(stages, x)
    assert [model.layers[str(i)][1].calls for i in range(2)] == [1, 1]  # the real modules ran, once each
    torch.testing.assert_close(got, model(x))
