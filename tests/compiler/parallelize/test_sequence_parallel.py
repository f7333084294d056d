"""Where sequence parallelism splits the sequence (compiler/parallelize/sequence_parallel.py); parity of every SP
configuration with one process, and the shards stages exchange, are in tests/launches/test_parity.py."""

from __future__ import annotations

import pytest
import torch

from compiler.parallelize.sequence_parallel import _feeds_blocks_directly, _shard_example_values
from compiler.trace import trace_pipeline
from models import named_config, spec_of
from models.spec import TOKEN_EMBEDDING


def _first_stage(name: str, *, embedding_alone: bool, documents: bool = False):
    """The model traced into two stages: the first holds the embedding and half the blocks, or the embedding alone."""
    cfg = named_config(name)
    blocks_per_stage = [0, cfg.n_layers] if embedding_alone else [cfg.n_layers // 2, cfg.n_layers - cfg.n_layers // 2]
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
        tokens = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    example = (tokens, torch.zeros_like(tokens)) if documents else tokens
    return trace_pipeline(model, example_microbatch=example, blocks_per_stage=blocks_per_stage)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("embedding_alone", [False, True])
def test_the_embedding_reduce_scatters_only_where_nothing_is_added_to_it(documents, embedding_alone):
    """Llama's token embeddings are the residual stream (RoPE acts inside attention): reduce-scatter them.
    GPT-2 adds learned positions first: the sum is sliced after the add instead."""
    llama = _first_stage("llama3-debug", embedding_alone=embedding_alone, documents=documents).get_stage_module(0)
    gpt2 = _first_stage("tiny", embedding_alone=embedding_alone, documents=documents).get_stage_module(0)
    assert _feeds_blocks_directly(llama.graph, TOKEN_EMBEDDING)
    assert not _feeds_blocks_directly(gpt2.graph, TOKEN_EMBEDDING)


def test_boundary_values_become_sequence_shards_and_positions_stay_whole():
    stage = _first_stage("tiny", embedding_alone=False, documents=True).get_stage_module(1)
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    before = {n.name: tuple(n.meta["val"].shape) for n in placeholders}
    _shard_example_values(placeholders, 4)
    after = {n.name: tuple(n.meta["val"].shape) for n in placeholders}
    hidden = [name for name, shape in before.items() if len(shape) == 3]
    assert len(hidden) == 1 and after[hidden[0]] == (2, before[hidden[0]][1] // 4, before[hidden[0]][2])
    assert all(after[name] == shape for name, shape in before.items() if name not in hidden)  # int64 positions
