"""Multi-token prediction's modules for every family (models/common/mtp.py): built as the family's extra blocks, the
model itself unchanged, name-seeded values, FLOPs, tensor-parallel plan data, and Hugging Face names as DeepSeek's
release stores them (every tensor round-trips, the shared copies written from the model's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import FAMILIES, build_model, flops_per_token, moe_layer_names, parameter_shapes, spec_of, tied_weights
from models.common.mtp import MTPLayer, extended, main_model_name, mtp_model_plan
from models.spec import SEQUENCE_LINEAR, SEQUENCE_NORM, VOCAB_EMBEDDING

SPECS = list(FAMILIES.values())
DEPTH = 2


def _with_depth(spec, depth: int = DEPTH):
    return dataclasses.replace(spec.sizes[spec.debug_size], mtp_depth=depth)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_the_depths_are_the_familys_next_blocks_and_leave_the_model_as_it_was(spec):
    cfg = _with_depth(spec)
    model, alone = build_model(cfg, seed=3), build_model(dataclasses.replace(cfg, mtp_depth=0), seed=3)
    longer = build_model(extended(cfg), seed=3)
    assert list(model.layers) == list(alone.layers) and list(model.mtp.layers) == ["0", "1"]
    assert model.mtp.embed.weight is model.tok_emb.weight  # the shared embedding, one Parameter in one process
    for k, layer in model.mtp.layers.items():
        assert isinstance(layer, MTPLayer) and type(layer.enorm) is type(model.norm)
        block, twin = layer.block, longer.layers[str(cfg.n_layers + int(k))]
        assert type(block) is type(twin)  # DeepSeek-V3's depth is a mixture-of-experts block, as block L would be
        for name, p in block.named_parameters():
            # block L + k's values, its residual projections scaled by this model's depth L
            want = spec.initial_value(f"layers.{cfg.n_layers + int(k)}.{name}", tuple(p.shape), seed=3, cfg=cfg)
            assert torch.equal(p, want), name
        assert torch.equal(layer.norm.weight, model.norm.weight) and layer.eh_proj.weight.std() > 0.01
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), alone(tokens))  # forward never runs the depths
        assert torch.equal(model.logits(model.hidden(tokens)), model(tokens))
    kinds = spec.block_kinds(extended(cfg))[cfg.n_layers:]
    assert [n for n in moe_layer_names(cfg) if n.startswith("mtp.")] == [
        f"mtp.layers.{k}.block.moe" for k, kind in enumerate(kinds) if kind == "moe"]
    assert tied_weights(cfg)["mtp.embed.weight"] == "tok_emb.weight"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_the_depths_predict_from_the_hidden_state_and_the_shifted_tokens(spec):
    """Depth logits (B, T, V) each; a position's logits depend on no later position's token (causal), and depth 2
    on depth 1's hidden state."""
    cfg = _with_depth(spec)
    model = build_model(cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=g)
    future = torch.randint(0, cfg.vocab_size, (1, 16, DEPTH), generator=g)
    with torch.no_grad():
        hidden = model.hidden(tokens)
        logits = model.mtp(hidden, future, model.head)
        changed = future.clone()
        changed[0, 10:, 0] = (changed[0, 10:, 0] + 1) % cfg.vocab_size  # depth 1's inputs from position 10 on
        after = model.mtp(hidden, changed, model.head)
    assert len(logits) == DEPTH and all(t.shape == (1, 16, cfg.vocab_size) for t in logits)
    for k in range(DEPTH):
        # (a mixture groups tokens by expert: other groups, other summation orders, 1e-8 apart)
        torch.testing.assert_close(after[k][0, :10], logits[k][0, :10], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(after[k][0, 10:], logits[k][0, 10:])  # depth 2 sees depth 1's h^1


def test_initial_values_follow_the_models_rules():
    spec = FAMILIES["gpt2"]  # LayerNorm's weight and bias: the final norm's ones and zeros
    cfg = _with_depth(spec, 1)
    assert main_model_name("mtp.layers.0.block.ln1.weight", 4) == "layers.4.ln1.weight"
    assert main_model_name("mtp.layers.1.hnorm.bias", 4) == "norm.bias"
    assert main_model_name("mtp.embed.weight", 4) == "tok_emb.weight"
    assert main_model_name("mtp.layers.0.eh_proj.weight", 4) == "mtp.layers.0.eh_proj.weight"
    shapes = parameter_shapes(cfg)
    value = lambda name: spec.initial_value(name, shapes[name], seed=5, cfg=cfg)  # noqa: E731
    assert torch.equal(value("mtp.layers.0.enorm.weight"), torch.ones(cfg.d_model))
    assert torch.equal(value("mtp.layers.0.norm.bias"), torch.zeros(cfg.d_model))
    assert torch.equal(value("mtp.embed.weight"), value("tok_emb.weight"))
    projection = value("mtp.layers.0.eh_proj.weight")  # (d, 2d), N(0, 0.02)
    assert not torch.equal(projection[:, :cfg.d_model], projection[:, cfg.d_model:]) and projection.std() > 0.01


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_flops_count_each_depths_block_projection_and_head(spec):
    cfg = _with_depth(spec)
    d, v = cfg.d_model, cfg.vocab_size
    base = dataclasses.replace(cfg, mtp_depth=0)
    blocks = flops_per_token(extended(cfg)) - flops_per_token(base)
    assert flops_per_token(cfg) == pytest.approx(flops_per_token(base) + blocks + DEPTH * 6 * (2 * d * d + d * v))
    assert blocks > 0


def test_the_tensor_parallel_plan_splits_the_embedding_copy_and_keeps_sequence_shards():
    assert mtp_model_plan(0, sequence_parallel=True) == {}
    assert mtp_model_plan(2, sequence_parallel=False) == {"mtp.embed": VOCAB_EMBEDDING}
    plan = mtp_model_plan(2, sequence_parallel=True)
    assert plan["mtp.layers.1.eh_proj"] == SEQUENCE_LINEAR
    assert {plan[f"mtp.layers.1.{n}"] for n in ("enorm", "hnorm", "norm")} == {SEQUENCE_NORM}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_every_tensor_round_trips_through_the_releases_names(spec):
    for tie in (True, False):
        cfg = dataclasses.replace(_with_depth(spec), tie_embeddings=tie)
        model = build_model(cfg, seed=11)
        state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        hf = spec.hf.to_hf(state, cfg)
        prefix = spec.hf.to_hf({n: t for n, t in state.items() if not n.startswith("mtp.")},
                               dataclasses.replace(cfg, mtp_depth=0))
        for k in range(DEPTH):
            layer = next(n for n in hf if n.endswith(".eh_proj.weight") and f".{cfg.n_layers + k}." in n)
            at = layer.removesuffix(".eh_proj.weight")
            assert f"{at}.shared_head.norm.weight" in hf and f"{at}.enorm.weight" in hf, at
            assert torch.equal(hf[f"{at}.embed_tokens.weight"], state["tok_emb.weight"])
            assert torch.equal(hf[f"{at}.shared_head.head.weight"], state["head.weight"])
        assert set(prefix) < set(hf)  # the model's own tensors keep their names
        for name, tensor in state.items():
            sources, combine = spec.hf.from_hf(name, cfg)
            assert set(sources) <= set(hf), f"{name} reads {sources}, not all written"
            assert torch.equal(combine(*(hf[s] for s in sources)), tensor), name
        back = spec.hf.config_from_hf(spec.hf.config_to_hf(cfg))
        assert back.mtp_depth == DEPTH and spec_of(back) is spec
