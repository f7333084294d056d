"""The banded kernel's transient as the memory model prices it (compiler/planner/attention_memory.py
``banded_scores_bytes``) against the bytes torch's memory profiler counts in the operator's forward and backward
(models/common/banded_attention.py), and where it runs: gpt-oss's full and sliding layers, not Llama's SDPA."""

from __future__ import annotations

import pytest
import torch

from compiler.planner.attention_memory import banded_scores_bytes
from compiler.planner.shape import DecoderShape
from models import KEY_BLOCK, banded_attention, named_config
from runtime.observe.memory import peak_growth_during


def _gpt_oss(seq_len: int, *, d_model: int = 128) -> DecoderShape:
    return DecoderShape.from_config(named_config("gpt-oss-debug", n_layers=2, d_model=d_model, n_heads=8, n_kv_heads=4,
                                                 seq_len=seq_len))


@pytest.mark.parametrize(("seq_len", "d_model"), [
    (KEY_BLOCK, 128),  # the last chunk's keys in one block: its scores and their copy with the sink's column
    (4 * KEY_BLOCK, 128),  # in 4 blocks: one block's scores and the block's keys expanded over a group (head_dim 16)
    (2 * KEY_BLOCK, 512),  # ... at head_dim 64
])
def test_a_full_layers_transient_is_the_counted_peak_of_its_last_queries_forward_and_backward(seq_len, d_model):
    shape = _gpt_oss(seq_len, d_model=d_model)
    full = [kind for kind in shape.kinds() if "@" not in kind][0]
    torch.manual_seed(0)
    lq = 512  # the sequence's last queries: their chunks meet all T keys, as the last cp chunk's do
    q = torch.randn(1, shape.heads, lq, shape.head_dim, requires_grad=True)
    k, v = (torch.randn(1, shape.kv_heads, seq_len, shape.head_dim, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(1, shape.heads, lq, requires_grad=True)
    (out, lse), counted = peak_growth_during(lambda: banded_attention(q, k, v, sinks=sinks, q_offset=seq_len - lq),
                                             torch.device("cpu"))
    counted -= out.untyped_storage().nbytes() + lse.untyped_storage().nbytes()  # its outputs are saved, not transient
    priced = banded_scores_bytes(shape, full, micro_batch_size=1, mp=1)
    assert abs(priced - counted) <= 0.05 * counted
    _, counted = peak_growth_during(lambda: out.backward(torch.ones_like(out)), torch.device("cpu"))
    counted -= sum(t.grad.untyped_storage().nbytes() for t in (q, k, v, sinks))  # the gradients outlive it
    priced = banded_scores_bytes(shape, full, micro_batch_size=1, mp=1, backward=True)
    assert abs(priced - counted) <= 0.05 * counted


def test_the_transient_grows_with_t_up_to_a_key_block_on_full_layers_only_and_not_under_sdpa():
    def priced(seq_len: int, kind_index: int, *, mp: int = 1, backward: bool = False) -> float:
        shape = _gpt_oss(seq_len)
        return banded_scores_bytes(shape, shape.kinds()[kind_index], micro_batch_size=1, mp=mp, backward=backward)

    sliding, full = _gpt_oss(KEY_BLOCK).kinds()[:2]
    assert "@" in sliding and "@" not in full
    assert priced(KEY_BLOCK, 1, backward=True) == 2 * priced(KEY_BLOCK // 2, 1, backward=True)
    for backward in (False, True):  # past a block the keys come one block at a time, at any T
        assert priced(4 * KEY_BLOCK, 1, backward=backward) == priced(64 * KEY_BLOCK, 1, backward=backward)
    assert priced(4 * KEY_BLOCK, 1) < priced(KEY_BLOCK, 1)  # no copy of the block with the sink's column
    assert priced(4 * KEY_BLOCK, 0) == priced(KEY_BLOCK, 0) > 0
    assert priced(KEY_BLOCK, 1, mp=2) == priced(KEY_BLOCK, 1) / 2
    llama = DecoderShape.from_config(named_config("llama3-debug", seq_len=KEY_BLOCK))
    assert banded_scores_bytes(llama, llama.kinds()[0], micro_batch_size=1, mp=1) == 0.0
