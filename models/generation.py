"""Autoregressive decoding with a KV cache: the prompt runs once, then one token per forward.

Works with every family's model (``forward(tokens, cache=KVCache)``, models/kv_cache.py). Sampling is
greedy at temperature 0; otherwise softmax(logits / temperature) over the ``top_k`` most likely tokens
(all when None), drawn with the given generator, so a seed repeats a sample.
"""

from __future__ import annotations

import torch
from torch import nn

from models.kv_cache import KVCache


def next_token(logits: torch.Tensor, *, temperature: float, top_k: int | None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) token ids."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probabilities = scaled.softmax(-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, *, n_layers: int, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """(B, P) prompt ids -> (B, N) new ids, N = max_new_tokens, or fewer once every row has produced one of
    ``stop_ids`` (an end-of-sequence id; it is the row's last id, a row that stopped earlier runs on to N).
    The model must have room for P + max_new_tokens - 1 positions (the last new token is never fed back)."""
    cache = KVCache(n_layers, capacity=prompt.shape[1] + max_new_tokens - 1)
    logits = model(prompt, cache=cache)[:, -1]  # (B, V): the prompt in one forward
    stops = torch.tensor(stop_ids, dtype=torch.long, device=prompt.device)
    stopped = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)  # (B,)
    new = []
    for i in range(max_new_tokens):
        token = next_token(logits, temperature=temperature, top_k=top_k, generator=generator)  # (B,)
        new.append(token)
        if stop_ids:  # (the check reads the device: only when there is something to stop at)
            stopped |= torch.isin(token, stops)
            if bool(stopped.all()):
                break
        if i + 1 < max_new_tokens:
            logits = model(token[:, None], cache=cache)[:, -1]  # one position: the cache holds the rest
    return torch.stack(new, dim=1)
