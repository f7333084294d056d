"""--compile: every block of a traced stage runs through inductor and computes what eager computes."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from compiler.parallelize.activation_checkpointing import maybe_apply_ac
from compiler.parallelize.compile import apply_compile
from compiler.parallelize.tensor_parallel import block_names, restore_linear_modules
from compiler.trace import trace_pipeline
from models import build_model, named_config

# Without checkpointing: more blocks on one stage than dynamo's default recompile limit (8), none of which may fall
# back to eager. With it: two blocks (each block an inductor compile: the limit needs checking once).
LAYERS = {"none": 10, "full": 2, "selective": 2}


def _config(checkpointing: str):
    return named_config("tiny", n_layers=LAYERS[checkpointing], d_model=32, n_heads=2, mlp_width=64, tie_embeddings=False)


def _stage(seed: int, tokens: torch.Tensor, *, checkpointing: str):
    cfg = _config(checkpointing)
    model = build_model(cfg, seed=seed)
    stage = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[cfg.n_layers]).get_stage_module(0)
    restore_linear_modules(stage, model)
    return maybe_apply_ac(stage, checkpointing)


@pytest.mark.parametrize("checkpointing", list(LAYERS))
def test_compiled_blocks_match_eager_and_every_block_is_compiled(checkpointing):
    torch._dynamo.reset()
    counters.clear()
    cfg = _config(checkpointing)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    eager = _stage(3, tokens, checkpointing=checkpointing)
    compiled = apply_compile(_stage(3, tokens, checkpointing=checkpointing))
    assert len(block_names(compiled)) == cfg.n_layers

    out_eager, out_compiled = eager(tokens), compiled(tokens)
    out_eager.float().square().mean().backward()
    out_compiled.float().square().mean().backward()

    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-4, atol=1e-5)
    grads = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
    # One dynamo frame per block, none given up on (a frame past the recompile limit runs eager).
    assert counters["stats"]["unique_graphs"] >= cfg.n_layers
