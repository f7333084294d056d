"""runtime/config.py's model check, the edge where a model's ``ShapeProblem`` (config fields) becomes one line
naming the flags: --heads for n_heads, --mp for the tensor-parallel ranks, and --model for the fields only a
size sets."""

from __future__ import annotations

import dataclasses

import pytest

from models import named_config
from runtime.config import ConfigError, _check_model


@pytest.mark.parametrize(("name", "fields", "mp", "line"), [
    ("llama3-debug", {}, 4, "--mp 4 must divide the key/value head count (--kv-heads 2); valid --mp values: 1, 2"),
    ("tiny", {"n_heads": 3}, 1, "--heads 3 must divide the model width (--d-model 64); valid --heads values: 1, 2, 4, "
                                "8, 16, 32, 64"),
    ("llama3-debug", {"d_model": 60, "head_dim": 15}, 1,
     "the head dimension (--d-model / --heads = 15) must be even for rotary embeddings"),
    # Fields no flag sets come with the size that set them.
    ("qwen3-debug", {"head_dim": 15}, 1, "--model: head_dim 15 must be even for rotary embeddings"),
    ("mixtral-debug", {"top_k": 9}, 1, "--model: top_k 9 must be between 1 and the expert count (n_experts 8)"),
])
def test_the_models_problem_names_the_flags(name, fields, mp, line):
    with pytest.raises(ConfigError) as raised:
        _check_model(dataclasses.replace(named_config(name), **fields), mp)
    assert str(raised.value) == line


def test_a_shape_that_runs_passes():
    _check_model(named_config("llama3-debug"), 2)
