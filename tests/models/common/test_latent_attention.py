"""Multi-head latent attention (models/common/latent_attention.py) against transformers' DeepseekV3Attention
transcribed here (interleaved and plain RoPE, with and without a q LoRA rank, YaRN's factors), a tensor-parallel
shard of its heads, and the latent KV cache."""

from __future__ import annotations

import pytest
import torch

from models import KVCache
from models.common.latent_attention import LatentAttention
from models.common.rope import Rope, YaRN
from models.spec import LatentSizes
from tests.models.common.test_rope import transformers_yarn

# deepseek-v3-yarn-mscale's YaRN: every factor differs from 1 (cos / sin 1.0942, softmax 1.2188).
YARN = {"rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
D = 24


def _attention(*, n_heads: int = 4, q_lora_rank: int = 12, interleave: bool = True, seed: int = 0) -> LatentAttention:
    yarn = YaRN(factor=8.0, original_context=64, mscale=1.0, mscale_all_dim=0.5)
    shape = LatentSizes(n_heads=n_heads, q_lora_rank=q_lora_rank, kv_lora_rank=10, nope_dim=6, rope_dim=8, v_dim=5)
    torch.manual_seed(seed)
    attn = LatentAttention(d_model=D, shape=shape, rope=Rope(theta=10000.0, factor=None, yarn=yarn), norm_eps=1e-6,
                           rope_interleave=interleave, softmax_factor=yarn.softmax_factor())
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return attn


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def transformers_attention(attn: LatentAttention, x: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """DeepseekV3Attention.forward (transformers 5) with eager attention, its weights taken from ``attn``."""
    s, (B, T, _) = attn.shape, x.shape
    q = attn.q(attn.q_a_norm(attn.q_a(x))) if s.q_lora_rank else attn.q(x)
    q_pass, q_rot = q.view(B, T, -1, s.qk_dim).transpose(1, 2).split([s.nope_dim, s.rope_dim], dim=-1)
    k_pass, k_rot = attn.kv_a(x).split([s.kv_lora_rank, s.rope_dim], dim=-1)
    k_pass = attn.kv_b(attn.kv_a_norm(k_pass)).view(B, T, -1, s.nope_dim + s.v_dim).transpose(1, 2)
    k_pass, value = k_pass.split([s.nope_dim, s.v_dim], dim=-1)
    k_rot = k_rot.view(B, 1, T, s.rope_dim)
    inv_freq, attention_scaling = transformers_yarn(YARN, s.rope_dim)
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * torch.tensor(inv_freq, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling  # (T, rope)
    if interleave:  # apply_rotary_pos_emb_interleave
        q_rot, k_rot = (t.view(*t.shape[:3], -1, 2).transpose(4, 3).reshape(t.shape) for t in (q_rot, k_rot))
    q_rot, k_rot = q_rot * cos + _rotate_half(q_rot) * sin, k_rot * cos + _rotate_half(k_rot) * sin
    k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
    query, key = torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_pass, k_rot), dim=-1)
    scaling = s.qk_dim ** -0.5 * (0.1 * 0.5 * torch.log(torch.tensor(8.0)).item() + 1) ** 2  # mscale_all_dim 0.5
    scores = query @ key.transpose(2, 3) * scaling
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ value  # (B, H, T, v)
    return attn.o(out.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("q_lora_rank", [12, 0])
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_attention_is_transformers_deepseek_v3_attention(interleave, q_lora_rank):
    attn = _attention(q_lora_rank=q_lora_rank, interleave=interleave)
    x = torch.randn(2, 11, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = transformers_attention(attn, x, interleave=interleave)
        torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)
        # The layout matters: the other convention computes something else on the same weights.
        assert not torch.allclose(transformers_attention(attn, x, interleave=not interleave), want, atol=1e-3)
    assert hasattr(attn, "q_a") == bool(q_lora_rank)


def test_a_tensor_parallel_shard_computes_its_heads():
    """A rank holding H/mp heads (rows of q and kv_b, columns of o; q_a, kv_a and their norms replicated) gives its
    share of the output: the shards' outputs sum to the whole's, and so do their gradients of the replicated down
    projection (each rank's heads give part of it: the engine sums them over mp)."""
    mp, heads = 2, 4
    whole = _attention(n_heads=heads)
    s = whole.shape
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(2))
    total, kv_a_grads = torch.zeros(2, 9, D), []
    for rank in range(mp):
        shard = _attention(n_heads=heads // mp, seed=rank + 5)
        per = heads // mp
        with torch.no_grad():
            for name in ("q_a", "q_a_norm", "kv_a", "kv_a_norm"):
                shard.get_submodule(name).weight.copy_(whole.get_submodule(name).weight)
            shard.q.weight.copy_(whole.q.weight.view(heads, s.qk_dim, -1)[rank * per:(rank + 1) * per].flatten(0, 1))
            shard.kv_b.weight.copy_(whole.kv_b.weight.view(heads, s.nope_dim + s.v_dim, -1)[rank * per:(rank + 1) * per]
                                    .flatten(0, 1))
            shard.o.weight.copy_(whole.o.weight[:, rank * per * s.v_dim:(rank + 1) * per * s.v_dim])
        out = shard(x)
        out.sum().backward()
        kv_a_grads.append(shard.kv_a.weight.grad)
        total += out.detach()
    want = whole(x)
    want.sum().backward()
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_a_grads[0] + kv_a_grads[1], whole.kv_a.weight.grad, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kv_a_grads[0], whole.kv_a.weight.grad, atol=1e-3)


def test_the_cache_holds_each_tokens_latent_and_rope_key_and_gives_one_forwards_output():
    attn = _attention().eval()
    s = attn.shape
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(3))
    cache = KVCache(1, capacity=12)
    chunks = []
    with torch.no_grad():
        for a, b in ((0, 5), (5, 6), (6, 12)):
            chunks.append(attn(x[:, a:b], torch.arange(a, b).expand(2, -1), cache=cache.layer(0)))
            cache.advance(b - a)
        torch.testing.assert_close(torch.cat(chunks, dim=1), attn(x), rtol=1e-5, atol=1e-5)
    latents, rope_keys = cache._buffers[0]
    assert latents.shape == (2, 12, s.kv_lora_rank) and rope_keys.shape == (2, 12, s.rope_dim)  # per token, not head
