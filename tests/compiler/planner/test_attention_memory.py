"""The banded kernel's transient scores as the memory model prices them (compiler/planner/attention_memory.py
``banded_scores_bytes``) against the bytes torch's memory profiler counts in the operator's forward
(models/common/banded_attention.py), and where it runs: gpt-oss's full and sliding layers, not Llama's SDPA."""

from __future__ import annotations

import torch

from compiler.planner.attention_memory import banded_scores_bytes
from compiler.planner.shape import DecoderShape
from models import banded_attention, named_config
from runtime.observe.memory import peak_growth_during

T = 2048


def _gpt_oss() -> DecoderShape:
    return DecoderShape.from_config(named_config("gpt-oss-debug", n_layers=2, d_model=128, n_heads=8, n_kv_heads=4,
                                                 seq_len=T))


def test_a_full_layers_transient_is_the_counted_peak_of_its_last_queries_forward_and_backward():
    shape = _gpt_oss()
    full = [kind for kind in shape.kinds() if "@" not in kind][0]
    torch.manual_seed(0)
    lq = 512  # the sequence's last queries: their chunks meet all T keys, as the last cp chunk's do
    q = torch.randn(1, shape.heads, lq, shape.head_dim, requires_grad=True)
    k, v = (torch.randn(1, shape.kv_heads, T, shape.head_dim, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(1, shape.heads, lq, requires_grad=True)
    (out, lse), counted = peak_growth_during(lambda: banded_attention(q, k, v, sinks=sinks, q_offset=T - lq),
                                             torch.device("cpu"))
    counted -= out.untyped_storage().nbytes() + lse.untyped_storage().nbytes()  # its outputs are saved, not transient
    priced = banded_scores_bytes(shape, full, micro_batch_size=1, mp=1)
    assert abs(priced - counted) <= 0.05 * counted
    _, counted = peak_growth_during(lambda: out.backward(torch.ones_like(out)), torch.device("cpu"))
    counted -= sum(t.grad.untyped_storage().nbytes() for t in (q, k, v, sinks))  # the gradients outlive it
    priced = banded_scores_bytes(shape, full, micro_batch_size=1, mp=1, backward=True)
    assert abs(priced - counted) <= 0.05 * counted


def test_the_transient_grows_with_t_on_full_layers_only_and_not_under_sdpa():
    shape = _gpt_oss()
    sliding, full = shape.kinds()[:2]
    assert "@" in sliding and "@" not in full
    longer = DecoderShape.from_config(named_config("gpt-oss-debug", n_layers=2, d_model=128, n_heads=8, n_kv_heads=4,
                                                   seq_len=4 * T))
    assert banded_scores_bytes(longer, full, micro_batch_size=1, mp=1) == 4 * banded_scores_bytes(shape, full,
                                                                                                   micro_batch_size=1, mp=1)
    assert banded_scores_bytes(longer, sliding, micro_batch_size=1, mp=1) == banded_scores_bytes(shape, sliding,
                                                                                                 micro_batch_size=1, mp=1)
    assert banded_scores_bytes(shape, full, micro_batch_size=1, mp=2) == banded_scores_bytes(shape, full,
                                                                                           micro_batch_size=1, mp=1) / 2
    llama = DecoderShape.from_config(named_config("llama3-debug", seq_len=T))
    assert banded_scores_bytes(llama, llama.kinds()[0], micro_batch_size=1, mp=1) == 0.0
