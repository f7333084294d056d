"""The engine's trace of every registered family (compiler/trace.py): the model built on the meta device, as the
engine builds it, traces into two pipeline stages that compute the eager model, its output and every gradient, with
no head count (a tensor-parallel shard holds H / mp heads) and no device in the attention graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from compiler.parallelize.tensor_parallel import restore_linear_modules
from compiler.trace import trace_pipeline
from models import build_model, init_weights
from models.spec import MOE, ModelSpec
from tests.models.family_configs import SPECS, debug_config, family_id

# Config changes per family so that the two stages hold every kind of block the family has.
EVERY_BLOCK_KIND = {"qwen3_moe": dict(mlp_only_layers=(1,))}  # the debug size's blocks are all MoE: one dense
VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
B, T = 2, 32


def _traced(spec: ModelSpec) -> tuple[object, list[nn.Module], nn.Module]:
    """(config, the two stages initialised as the engine does, the eager model of the same weights). Untied: a tied
    head is a pipeline's last stage's copy. Evaluation mode where blocks are MoE: a traced graph keeps neither the
    load counts nor the auxiliary loss's backward (models/common/moe.py), which the engine runs on the eager module."""
    cfg = dataclasses.replace(debug_config(spec, seq_len=T), tie_embeddings=False, **EVERY_BLOCK_KIND.get(spec.family, {}))
    with torch.device("meta"):
        model = spec.build(cfg, share_tied_weights=False)
        example = torch.zeros(B, T, dtype=torch.long)  # on meta too, as the engine traces (compiler/parallelize/stages.py)
    pipe = trace_pipeline(model, example_microbatch=example, blocks_per_stage=[1, cfg.n_layers - 1])
    stages = [pipe.get_stage_module(i) for i in range(2)]
    for stage in stages:
        restore_linear_modules(stage, model)
        stage.to_empty(device="cpu")
        init_weights(stage, seed=9, cfg=cfg)
    reference = build_model(cfg, seed=9)
    return cfg, stages, reference.eval() if MOE in spec.block_kinds(cfg) else reference


def _tokens(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_the_meta_built_model_traces_into_stages_that_compute_the_eager_model(spec):
    cfg, stages, reference = _traced(spec)
    tokens = _tokens(cfg)
    got, want = stages[1](stages[0](tokens)), reference(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    grads = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            if p.requires_grad:  # a router's selection bias is not trained
                torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    _assert_no_head_count_and_no_device(spec, cfg, stages)


def _assert_no_head_count_and_no_device(spec: ModelSpec, cfg, stages: list[nn.Module]) -> None:
    """Every attention graph of the stages reshapes to (B, T, -1, ...) heads, takes the head count as no size and
    creates nothing on a device: a tensor-parallel shard of H / mp heads runs the same graph, on any device."""
    latent = spec.latent_attention(cfg)
    qk = latent.qk_dim if latent else cfg.head_dim
    graphs = [m.graph for stage in stages for name, m in stage.named_modules() if name.endswith(".attn")]
    assert len(graphs) == cfg.n_layers
    for graph in graphs:
        # Every size an op takes (not a permutation's dims); the debug sizes' head count is none of their other sizes.
        sizes = [list(a) for node in graph.nodes if node.target != torch.ops.aten.permute.default for a in node.args
                 if isinstance(a, (list, tuple)) and a and all(isinstance(i, int) for i in a)]
        assert not [s for s in sizes if cfg.n_heads in s], sizes
        views = [list(node.args[1]) for node in graph.nodes if node.target in VIEWS]
        assert views and all(v[:3] == [B, T, -1] for v in views), views  # (B, T, heads, ...): heads left to -1
        assert any(len(v) >= 4 and v[-1] == qk for v in views), views  # the queries' (B, T, -1, qk)
        assert "device" not in str(graph)  # nothing created on the trace's meta device


# A mixture's traced stages do not compute its eager model bit for bit under bf16 autocast (their logits differ in the
# second decimal), probably because the router's autocast-off and the experts' cast (models/common/router.py, moe.py)
# are decided in Python at trace time, on the meta device where autocast is off. Strict: the mark fails once they agree.
MIXTURE_UNDER_AUTOCAST = pytest.mark.xfail(strict=True, reason="traced MoE stages differ from eager under bf16 autocast")


@pytest.mark.parametrize("spec", [pytest.param(s, marks=MIXTURE_UNDER_AUTOCAST) if MOE in s.block_kinds(debug_config(s))
                                  else s for s in SPECS], ids=family_id)
def test_the_traced_stages_compute_the_eager_model_bit_for_bit_under_bf16_autocast(spec):
    cfg, stages, reference = _traced(spec)
    tokens = _tokens(cfg)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast at run time, as the engine
        torch.testing.assert_close(stages[1](stages[0](tokens)), reference(tokens), rtol=0, atol=0)
