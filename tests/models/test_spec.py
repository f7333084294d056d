"""models/spec.py's ``ShapeProblem``: a model states why its shape cannot run in its own terms, config fields and
never command-line flags (the engine's edge names those: tests/runtime/test_config_shapes.py)."""

from __future__ import annotations

import dataclasses

import pytest

from models import MODEL_NAMES, named_config, spec_of
from models.common.router import Router, Routing
from models.spec import MP, ModelShapeError, ShapeProblem

# A broken shape for every family: 3 heads split neither GPT-2's width of 64 nor into 2 key/value heads.
BROKEN = {"n_heads": 3, "n_kv_heads": 2}


@pytest.mark.parametrize("name", sorted({spec.debug_size for spec, _ in MODEL_NAMES.values()}))
def test_every_familys_check_names_config_fields_never_flags(name):
    cfg = named_config(name)
    settable = {f.name for f in dataclasses.fields(cfg)}
    broken_heads = dataclasses.replace(cfg, **{k: v for k, v in BROKEN.items() if k in settable})
    for broken, mp in ((broken_heads, 2), (cfg, 3)):
        problem = spec_of(cfg).check(broken, mp)
        assert isinstance(problem, ShapeProblem), (name, mp)
        assert "--" not in problem.message() and problem.field in (MP, "n_heads", "n_kv_heads", "d_model", "mlp_width")
        assert set(problem.fields) <= {MP, *dataclasses.asdict(broken)}


def test_a_problem_reads_as_one_line_in_whatever_names_it_is_given():
    problem = ShapeProblem(MP, 4, "divide", "n_kv_heads", 2, valid=(1, 2))
    assert problem.message() == "mp 4 must divide the key/value head count (n_kv_heads 2); valid mp values: 1, 2"
    assert problem.message(str.upper) == "MP 4 must divide the key/value head count (N_KV_HEADS 2); valid MP values: 1, 2"
    derived = ShapeProblem("head_dim", 15, "be even", reason="for rotary embeddings", derived_from=("d_model", "n_heads"))
    assert derived.fields == ("d_model", "n_heads")
    assert derived.message() == "the head dimension (d_model / n_heads = 15) must be even for rotary embeddings"


def test_a_router_refuses_its_options_with_the_problem():
    with pytest.raises(ModelShapeError, match="topk_group 2") as raised:
        Router(8, 8, Routing(top_k=5, n_group=4, topk_group=2))
    assert raised.value.problem == ShapeProblem("topk_group", 2, "choose groups holding at least", "top_k", 5,
                                                valid=(3, 4), reason="among the 4 groups of 2 experts")
    assert isinstance(raised.value, ValueError)
