"""A sliding-window layer's KV cache holds only its window (models/kv_cache.py): gpt-oss's greedy decoding and cached
chunks with the rolling cache give the logits of the cache that keeps every position and of one forward, for prompts
shorter and longer than the window and generations crossing it; the sliding layers' buffers hold the kept W - 1 (at
most) plus the forward's t positions, the full layers' the capacity."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from models import KVCache, build_model, named_config
from models.kv_cache import LayerCache

BYTES = 4  # fp32
# One forward and the cache sum in other orders (fp32) with logits reaching 10: a lost key moves them by whole units.
TOLERANCE = {"rtol": 1e-4, "atol": 2e-4}


def _model(window: int):
    """gpt-oss-debug (sliding, full, sliding, full; sinks) with a window of ``window`` and weights large enough that
    greedy decoding varies (at the init's 0.02 it repeats one token)."""
    cfg = dataclasses.replace(named_config("gpt-oss-debug"), sliding_window=window)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return cfg, model.eval()


@contextlib.contextmanager
def _every_position_kept():
    """The cache as it was before windows: every layer keeps every position (the band mask alone does the window)."""
    update = LayerCache.update
    LayerCache.update = lambda self, k, v, *, window=None: update(self, k, v)
    try:
        yield
    finally:
        LayerCache.update = update


def _greedy_logits(model, prompt: torch.Tensor, steps: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, steps) greedy ids and (B, steps, V) the logits each was chosen from, decoding one token per forward."""
    logits, ids = [model(prompt, cache=cache)[:, -1]], []
    for i in range(steps):
        ids.append(logits[-1].argmax(-1))
        if i + 1 < steps:
            logits.append(model(ids[-1][:, None], cache=cache)[:, -1])
    return torch.stack(ids, dim=1), torch.stack(logits, dim=1)


@pytest.mark.parametrize(("window", "prompt_len"), [(8, 5), (8, 19), (3, 2), (3, 11)])
def test_greedy_decoding_with_the_window_capped_cache_gives_the_full_caches_and_full_forwards_logits(window, prompt_len):
    cfg, model = _model(window)
    prompt = torch.randint(0, cfg.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(0))
    steps = 3 * window  # the generation crosses the window several times
    with torch.no_grad():
        capped = KVCache(cfg.n_layers, capacity=prompt_len + steps)
        ids, logits = _greedy_logits(model, prompt, steps, capped)
        with _every_position_kept():
            full_ids, full_logits = _greedy_logits(model, prompt, steps, KVCache(cfg.n_layers, capacity=prompt_len + steps))
        sequence = torch.cat([prompt, ids], dim=1)
        forward = model(sequence)[:, prompt_len - 1:-1]  # (B, steps, V): the logits each new id was chosen from
    assert len(set(ids[0].tolist())) > 3, ids[0]  # varied: a wrong cache could not hide behind one repeated token
    assert torch.equal(ids, full_ids)
    assert torch.equal(logits, full_logits)  # the same keys in the same order: bit for bit
    torch.testing.assert_close(logits, forward, **TOLERANCE)
    assert torch.equal(forward.argmax(-1), ids)
    # Decoding one token at a time: a sliding layer holds window positions (W - 1 kept + 1 new), a full one capacity.
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * BYTES * prompt.shape[0]  # keys and values, every row
    for layer in range(cfg.n_layers):
        want = window if cfg.window(layer) else capped.capacity
        assert capped.held_bytes(layer) == want * per_position, layer


@pytest.mark.parametrize("window", [8, 3])
def test_cached_chunks_attend_over_the_kept_window_and_the_new_tokens(window):
    # Several new tokens at once after cached ones, chunks shorter and longer than the window: a sliding layer
    # attends over at most W - 1 kept positions and its t new ones, and holds just those.
    cfg, model = _model(window)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    cache = KVCache(cfg.n_layers, capacity=40)
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * BYTES * tokens.shape[0]
    chunks = []
    with torch.no_grad():
        for a, b in ((0, 3), (3, 15), (15, 16), (16, 17), (17, 30), (30, 40)):
            chunks.append(model(tokens[:, a:b], cache=cache))
            for layer in range(cfg.n_layers):
                want = min(window - 1, a) + (b - a) if cfg.window(layer) else cache.capacity
                assert cache.held_bytes(layer) == want * per_position, (a, b, layer)
        torch.testing.assert_close(torch.cat(chunks, dim=1), model(tokens), **TOLERANCE)
    assert cache.length == 40
