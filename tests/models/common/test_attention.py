"""Grouped-query attention (models/common/attention.py) split over tensor-parallel ranks by its heads, with and
without Qwen3's per-head q/k norms. (Each family's whole model against its reference: tests/models/.)"""

from __future__ import annotations

import pytest
import torch

from models.common.attention import Attention
from models.common.rope import Rope


@pytest.mark.parametrize("qk_norm", [None, 1e-6])
def test_a_tensor_parallel_shard_of_grouped_query_attention_computes_its_heads(qk_norm):
    """A rank holding H/mp query heads and Hkv/mp key/value heads (column-parallel q, k, v; row-parallel o) gives
    its share of the output: the shards' partial outputs sum to the whole attention's."""
    d, heads, kv_heads, hd, mp = 32, 8, 2, 8, 2
    rope = Rope(theta=10000.0, factor=None)
    whole = Attention(d_model=d, n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, rope=rope, qk_norm_eps=qk_norm)
    x = torch.randn(2, 12, d, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(2, 12, d)
    for rank in range(mp):
        shard = Attention(d_model=d, n_heads=heads // mp, n_kv_heads=kv_heads // mp, head_dim=hd, rope=rope,
                          qk_norm_eps=qk_norm)
        q_rows, kv_rows = slice(rank * heads * hd // mp, (rank + 1) * heads * hd // mp), slice(
            rank * kv_heads * hd // mp, (rank + 1) * kv_heads * hd // mp)
        with torch.no_grad():
            shard.q.weight.copy_(whole.q.weight[q_rows])
            shard.k.weight.copy_(whole.k.weight[kv_rows])
            shard.v.weight.copy_(whole.v.weight[kv_rows])
            shard.o.weight.copy_(whole.o.weight[:, q_rows])
            if qk_norm:
                shard.q_norm.weight.copy_(whole.q_norm.weight)
                shard.k_norm.weight.copy_(whole.k_norm.weight)
            total += shard(x)
    with torch.no_grad():
        torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-6)
