"""The generic checks every registered model family passes: the naming contract, plans that name real
modules, tied weights, name-seeded initial values, flag overrides, parameter counts, the Hugging Face
adapter's round trip, document masks and shorter windows. The other per-family checks: tests/models/test_family_*.py
(published sizes and FLOPs, config.json generations and refusals, the meta-device trace, the flag checks); parity
with one process at one mesh: tests/launches/test_parity.py, a case per family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import (
    MODEL_NAMES,
    build_model,
    config_from_dict,
    config_to_dict,
    parameter_count,
    parameter_shapes,
    spec_of,
    with_window,
)
from models.spec import (
    COLWISE,
    GATHER_SEQUENCE,
    HEAD_NORM,
    HEAD_SHARED,
    HEADWISE,
    LM_HEAD,
    MOE,
    REPLICATED,
    ROWWISE,
    ROWWISE_SCATTER,
    SEQUENCE_NORM,
    TOKEN_EMBEDDING,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
)
from runtime.engine.data.inputs import document_ids
from tests.models.family_configs import SPECS, as_read_from_hf, debug_config, family_id

LINEAR_STYLES = {COLWISE, ROWWISE, ROWWISE_SCATTER, REPLICATED}


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_the_model_follows_the_naming_contract(spec):
    cfg = debug_config(spec, seq_len=16)
    model = build_model(cfg, seed=0)
    assert isinstance(getattr(model, TOKEN_EMBEDDING), nn.Embedding)
    assert isinstance(getattr(model, LM_HEAD), nn.Linear)
    assert list(model.layers.keys()) == [str(i) for i in range(cfg.n_layers)]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.embed(tokens)
        for block in model.layers.values():
            x = block(x)
        torch.testing.assert_close(model.logits(x), model(tokens), rtol=0, atol=0)
    assert model(tokens).shape == (2, cfg.seq_len, cfg.vocab_size)


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_every_plan_key_names_a_module_of_the_right_kind(spec):
    cfg = debug_config(spec)
    model = spec.build(cfg)
    plan = spec.block_plan(sequence_parallel=True)
    named = set()
    for block_name, block in model.layers.named_children():
        held = dict(block.named_modules())
        # A family with two kinds of blocks (dense, mixture of experts) names both kinds' modules; each block takes
        # the entries it has (compiler/parallelize/tensor_parallel.py), and every entry names some block's module.
        for key, style in plan.items():
            if key not in held:
                continue
            named.add(key)
            module = held[key]
            if style in LINEAR_STYLES:
                assert isinstance(module, nn.Linear), f"layers.{block_name}.{key} is {type(module).__name__}"
            elif style in (SEQUENCE_NORM, HEAD_NORM):
                assert not list(module.children()) and any(True for _ in module.parameters()), f"{key}: a norm"
            elif style == HEAD_SHARED:  # a tensor's way from the replicated part to the heads: nothing to shard
                assert not list(module.children()) and not list(module.parameters()), f"{key}: no parameters"
            elif style == HEADWISE:  # per-head parameters (attention sinks): one value per query head on dim 0
                params = list(module.parameters())
                assert not list(module.children()) and params, f"{key}: a leaf with parameters"
                heads = model.layers[block_name].attn.q.out_features // model.layers[block_name].attn.head_dim
                assert all(p.shape[0] == heads for p in params), f"{key}: {heads} heads on dim 0"
            else:
                assert style == GATHER_SEQUENCE and list(module.children()), f"{key}: a module with children"
    kinds_of_blocks = set(spec.block_kinds(cfg))
    unnamed = set(plan) - named
    # Only a dense MLP's entries may name nothing, in a mixture whose blocks are all MoE.
    assert not unnamed or kinds_of_blocks == {MOE}, f"plan entries naming no module: {unnamed}"
    assert all(k == "mlp" or k.startswith("mlp.") for k in unnamed), unnamed
    kinds = {VOCAB_EMBEDDING: nn.Embedding, VOCAB_HEAD: nn.Linear}
    for key, style in spec.model_tp_plan.items():
        assert isinstance(model.get_submodule(key), kinds[style]), key
    # The plain plan is Megatron's: every column-parallel matrix feeds a row-parallel one in the same module (what the
    # heads of a rank share sums its gradient over the ranks).
    styles = set(spec.block_tp_plan.values())
    assert styles - {HEAD_NORM, HEAD_SHARED, HEADWISE} == {COLWISE, ROWWISE}


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_tied_weights_name_parameters_and_tie_only_when_asked(spec):
    for tie in (True, False):
        cfg = debug_config(spec, tie_embeddings=tie)
        model = spec.build(cfg)
        shared = {n for n, _ in model.named_parameters()}  # a tied copy is not listed twice
        for copy, source in spec.tied_weights.items():
            assert source in shared
            assert (copy in shared) is not tie
            assert (model.get_parameter(copy) is model.get_parameter(source)) is tie
        untied = spec.build(cfg, share_tied_weights=False)
        for copy, source in spec.tied_weights.items():
            assert untied.get_parameter(copy) is not untied.get_parameter(source)


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_initial_values_are_name_seeded_and_tied_copies_start_equal(spec):
    cfg = debug_config(spec)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    # One parameter's value does not depend on which others are built (a stage builds only its own).
    name, p = next((n, p) for n, p in a.named_parameters() if n.startswith("layers.1.") and p.dim() == 2)
    assert torch.equal(spec.initial_value(name, tuple(p.shape), seed=3, cfg=cfg), p.detach())
    assert not torch.equal(spec.initial_value(name, tuple(p.shape), seed=4, cfg=cfg), p.detach())
    tied = debug_config(spec, tie_embeddings=True)
    for copy, source in spec.tied_weights.items():
        shape = tuple(spec.build(tied).get_parameter(source).shape)
        assert torch.equal(spec.initial_value(copy, shape, seed=1, cfg=tied),
                           spec.initial_value(source, shape, seed=1, cfg=tied))


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_configs_round_trip_through_checkpoint_dicts_and_hf_config(spec):
    for name, cfg in spec.sizes.items():
        assert config_from_dict(config_to_dict(cfg)) == cfg, name
        assert spec.hf.config_from_hf(spec.hf.config_to_hf(cfg)) == as_read_from_hf(cfg), name
        assert spec.hf.config_to_hf(cfg)["architectures"][0] == spec.hf.architectures[0]


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_the_hf_adapter_round_trips_every_parameter(spec):
    for tie in (True, False):
        cfg = debug_config(spec, tie_embeddings=tie, seq_len=16)
        model = build_model(cfg, seed=11)
        state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        hf = spec.hf.to_hf(state, cfg)
        for name, tensor in state.items():
            sources, combine = spec.hf.from_hf(name, cfg)
            assert set(sources) <= set(hf), f"{name} reads {sources}, not all written"
            assert torch.equal(combine(*(hf[s] for s in sources)), tensor), name
        # Meta tensors give the Hugging Face names and shapes without data (a loader's shape check).
        meta = spec.hf.to_hf({n: t.to("meta") for n, t in state.items()}, cfg)
        assert {n: t.shape for n, t in meta.items()} == {n: t.shape for n, t in hf.items()}


def test_named_sizes_are_unique_and_parameter_counts_are_positive():
    for name, (spec, cfg) in MODEL_NAMES.items():
        assert cfg.family == spec.family and spec_of(cfg) is spec, name
        assert spec.check(cfg, 1) is None, name
    assert parameter_count(debug_config(SPECS[0])) > 0


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_packed_documents_attend_only_within_their_document(spec):
    cfg = debug_config(spec, seq_len=16)
    model = build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, cfg.vocab_size, (1, 6), generator=g), torch.randint(0, cfg.vocab_size, (1, 10), generator=g)
    packed = torch.cat([first, second], dim=1)  # (1, 16): two documents
    positions = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    with torch.no_grad():
        logits = model(packed, positions, document_ids(positions))  # ids carried with the batch, not derived here
        torch.testing.assert_close(logits[:, 6:], model(second), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[:, :6], model(first), rtol=1e-5, atol=1e-5)
        # One document spanning the window is plain causal attention.
        whole = torch.arange(16).unsqueeze(0)
        torch.testing.assert_close(model(packed, whole, torch.zeros_like(whole)), model(packed), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits[:, 6:], model(packed)[:, 6:], atol=1e-4)  # the mask does something
        # Positions restarting without document ids are still one document: positions alone mask nothing.
        assert not torch.allclose(model(packed, positions)[:, 6:], model(second), atol=1e-3)
        torch.testing.assert_close(model(packed, whole), model(packed), rtol=1e-5, atol=1e-6)  # the default positions


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_a_shorter_window_keeps_the_models_context_and_every_shape(spec):
    cfg = debug_config(spec)
    short = with_window(cfg, cfg.seq_len // 4)
    assert short.seq_len == cfg.seq_len // 4 and short.context == cfg.context
    assert parameter_shapes(short) == parameter_shapes(cfg)
    assert spec.hf.config_to_hf(short) == spec.hf.config_to_hf(cfg)  # an export writes the same model
    assert config_from_dict(config_to_dict(short)) == short
    with pytest.raises(ValueError, match=f"longer than the model's context of {cfg.context} positions"):
        with_window(cfg, cfg.context + 1)
    tokens = torch.randint(0, cfg.vocab_size, (1, short.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same weights at either window compute the same logits
        torch.testing.assert_close(build_model(short, seed=1)(tokens), build_model(cfg, seed=1)(tokens))
