"""Past keys and values for decoding: run the prompt once, then one new token per forward.

``model(tokens, cache=cache)`` runs the new tokens (B, t) at positions ``cache.length .. cache.length + t - 1``:
every attention layer appends its new keys and values to the cache and attends to all of them, and the model
then advances the cache by t. Keys are cached after RoPE (each rotated at its own position, so they never
change later) and before grouped-query attention repeats them (n_kv_heads heads, not n_heads), as Hugging
Face's and Meta's caches do. Multi-head latent attention (models/common/latent_attention.py) caches what its keys
and values are made of instead: per token the normalised latent and the rotated RoPE key every head shares
(``update_latent``: kv_lora_rank + rope values, not per head), as DeepSeek-V2 (sec. 2.1.1) caches them. Buffers
are allocated once, for ``capacity`` positions, on the first update.

**Sliding-window layers** (gpt-oss's, ``update(k, v, window=W)``) keep only what a later query can still see: a query
at position p sees keys p - W < j <= p, so the next forward's first query needs the last W - 1 positions and nothing
older. Such a layer's cache is a rolling buffer: a forward of t new tokens attends over the kept (at most W - 1)
positions followed by its t new ones, one tensor of at most W - 1 + t positions in position order (the prefill of a
prompt longer than the window attends over every prompt key, each query within its own window, exactly as a full
forward), and the layer then keeps a view of its last W - 1 positions, so it holds W - 1 + t positions between
forwards (W while decoding one token at a time) instead of ``capacity``. Keys keep their exact positions: they were
rotated before caching, and the window's mask counts from the first returned key (the new queries stand after
the kept ones, attention_core.py ``cached(q_offset=...)``). Rolling costs one copy of the kept positions per
forward, no more than the attention reads from them.

Nothing here is traced: the engine traces ``forward(tokens)`` (cache None), which never reaches this code.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, capacity: int):
        self.capacity = capacity  # positions the buffers hold: prompt + new tokens
        self.length = 0  # positions cached so far (the position of the next token)
        # per layer: (keys, values) each (B, Hkv, capacity, hd), or (latents, rope keys) (B, capacity, width)
        self._buffers: list[tuple[torch.Tensor, ...] | None] = [None] * n_layers

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, t) absolute positions of the new tokens (B, t): length .. length + t - 1."""
        batch, t = tokens.shape
        if self.length + t > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {self.length} are used, {t} more asked for")
        return torch.arange(self.length, self.length + t, device=tokens.device).expand(batch, t)

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def held_bytes(self, index: int) -> int:
        """Bytes layer ``index``'s buffers hold in memory (the storage under a sliding layer's views included)."""
        buffers = self._buffers[index] or ()
        return sum(t.untyped_storage().nbytes() for t in buffers)

    def advance(self, t: int) -> None:
        """After every layer has stored the t new positions (the model calls this once per forward)."""
        self.length += t

    def _append(self, index: int, new: tuple[torch.Tensor, ...], *, time_dim: int) -> tuple[torch.Tensor, ...]:
        """Store layer ``index``'s tensors of the new positions (along ``time_dim``); every position's so far."""
        if self._buffers[index] is None:
            self._buffers[index] = tuple(
                t.new_empty(*t.shape[:time_dim], self.capacity, *t.shape[time_dim + 1:]) for t in new)
        t = new[0].shape[time_dim]
        for buffer, values in zip(self._buffers[index], new):
            buffer.narrow(time_dim, self.length, t).copy_(values)
        return tuple(buffer.narrow(time_dim, 0, self.length + t) for buffer in self._buffers[index])

    def _roll(self, index: int, new: tuple[torch.Tensor, ...], *, time_dim: int, window: int) -> tuple[torch.Tensor, ...]:
        """Store a sliding layer's tensors of the new positions; the kept positions (at most ``window`` - 1) and the
        new ones, in position order. Keeps views of the last ``window`` - 1 for the next forward (module docstring)."""
        kept = self._buffers[index]
        seen = new if kept is None else tuple(torch.cat([old, values], dim=time_dim) for old, values in zip(kept, new))
        keep = min(window - 1, seen[0].shape[time_dim])
        self._buffers[index] = tuple(t.narrow(time_dim, t.shape[time_dim] - keep, keep) for t in seen)
        return seen


class LayerCache:
    """One attention layer's part of a ``KVCache``."""

    def __init__(self, cache: KVCache, index: int):
        self.cache = cache
        self.index = index

    @property
    def length(self) -> int:
        """Positions cached before this forward's new tokens."""
        return self.cache.length

    def update(self, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys and values (B, Hkv, t, hd) -> every position's so far (B, Hkv, length + t, hd); on a layer of a
        sliding ``window``, only the positions its new queries can see: the last min(length, window - 1) cached
        ones and the t new ones (B, Hkv, kept + t, hd), the new queries standing after the kept keys."""
        if window:
            return self.cache._roll(self.index, (k, v), time_dim=2, window=window)
        return self.cache._append(self.index, (k, v), time_dim=2)

    def update_latent(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head latent attention's new latents (B, t, kv_lora_rank) and rotated RoPE keys (B, t, rope) ->
        every position's so far (B, length + t, ...)."""
        return self.cache._append(self.index, (latent, rope_key), time_dim=1)

    def causal_arguments(self, t: int, device: torch.device) -> dict:
        """``scaled_dot_product_attention``'s causality for t new queries over length + t keys: query i (position
        length + i) sees keys 0 .. length + i. A prompt on an empty cache is plain causal attention (no mask); a
        single query sees every key; t queries after cached ones take a (t, length + t) mask (``is_causal``
        would align top-left)."""
        length = self.cache.length
        if t == 1:
            return {}
        if length == 0:
            return {"is_causal": True}
        return {"attn_mask": torch.ones(t, length + t, dtype=torch.bool, device=device).tril(diagonal=length)}
