"""The chunked cross-entropy against F.cross_entropy: exact in fp32 (values and gradients), within rounding on
bf16 logits, loss scaling through fp16 logits, and no fp32 copy of the logits in memory. The
vocabulary-parallel path runs on two gloo ranks in tests/launches/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiler.parallelize import cross_entropy
from compiler.parallelize.cross_entropy import (
    ACCELERATOR_CHUNK_BYTES,
    CPU_CHUNK_BYTES,
    IGNORE_INDEX,
    chunk_rows,
    chunked_cross_entropy,
)
from runtime.observe.memory import peak_growth_during


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)  # [N, V]
    targets = torch.randint(0, vocab, (rows,), generator=g)  # [N]
    targets[::5] = IGNORE_INDEX  # some rows add nothing (padding, F.cross_entropy's ignore_index)
    return logits, targets


def _value_and_grad(loss_fn, logits, targets, upstream=1.0):
    x = logits.clone().requires_grad_()
    loss = loss_fn(x, targets)
    (loss * upstream).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64, 1000])  # one row, uneven chunks, one chunk, more than N
def test_fp32_equals_f_cross_entropy(reduction, rows_per_chunk):
    logits, targets = _case(64, 37, torch.float32)
    got, got_grad = _value_and_grad(lambda x, y: chunked_cross_entropy(x, y, reduction=reduction,
                                                                       rows_per_chunk=rows_per_chunk),
                                    logits, targets, 0.7)
    want, want_grad = _value_and_grad(lambda x, y: F.cross_entropy(x, y, reduction=reduction), logits, targets, 0.7)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert (got_grad[targets == IGNORE_INDEX] == 0).all()


def test_bf16_logits_give_fp32_loss_and_a_bf16_gradient_within_rounding():
    logits, targets = _case(96, 300, torch.bfloat16)
    got, got_grad = _value_and_grad(lambda x, y: chunked_cross_entropy(x, y, rows_per_chunk=10), logits, targets)
    want, want_grad = _value_and_grad(lambda x, y: F.cross_entropy(x.float(), y), logits, targets)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # both upcast the same bf16 values
    # The gradient differs from the fp32 one by its rounding to bf16 (8 bits of mantissa).
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-8, atol=1e-9)


def test_fp16_logits_under_a_loss_scale_keep_the_scaled_gradient_finite():
    """GradScaler multiplies the loss by S (2^16 at first): the gradient of the fp16 logits is S times the
    fp32 one, written in fp16 without overflowing, as F.cross_entropy on upcast logits gives it."""
    logits, targets = _case(48, 128, torch.float16)
    scale = 2.0**16
    _, got_grad = _value_and_grad(lambda x, y: chunked_cross_entropy(x, y, rows_per_chunk=5), logits, targets, scale)
    _, want_grad = _value_and_grad(lambda x, y: F.cross_entropy(x.float(), y), logits, targets, scale)
    assert got_grad.dtype == torch.float16 and torch.isfinite(got_grad).all()
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-10, atol=1e-3)


def test_no_fp32_copy_of_the_logits_is_held():
    """On bf16 logits, forward and backward together grow live memory by less than one fp32 copy of the
    logits (the gradient, in bf16, is half of one; the fp32 chunks are small); F.cross_entropy on the
    upcast logits holds more than two fp32 copies at once (the copy or its log-softmax, and their gradients)."""
    logits, targets = _case(512, 2048, torch.bfloat16)
    fp32_copy = logits.numel() * 4

    def growth(loss_fn) -> int:
        x = logits.clone().requires_grad_()  # the last stage's output, live before its loss runs
        _, grown = peak_growth_during(lambda: loss_fn(x, targets).backward(), torch.device("cpu"))
        return grown

    chunked = growth(lambda x, y: chunked_cross_entropy(x, y, rows_per_chunk=64))
    plain = growth(lambda x, y: F.cross_entropy(x.float(), y))
    assert chunked < fp32_copy, f"chunked loss grew live memory by {chunked / fp32_copy:.2f} fp32 logits"
    assert plain > 2 * fp32_copy, f"F.cross_entropy grew live memory by {plain / fp32_copy:.2f} fp32 logits"


def test_chunks_hold_a_bounded_number_of_bytes():
    assert chunk_rows(50257, chunk_bytes=64 * 2**20) == 64 * 2**20 // (4 * 50257)
    assert chunk_rows(10**9) == 1  # at least one row


@pytest.mark.parametrize("device, chunk_bytes", [("cpu", CPU_CHUNK_BYTES), ("meta", ACCELERATOR_CHUNK_BYTES)])
def test_chunks_are_larger_on_accelerators(monkeypatch, device, chunk_bytes):
    """The CPU upcasts cache-sized chunks (2 MiB); anything else (a GPU; the meta device stands for one here) 256 MiB
    at once, the size the memory model prices there."""
    seen = []
    row_statistics = cross_entropy._row_statistics
    monkeypatch.setattr(cross_entropy, "_row_statistics", lambda x, local, rows: seen.append(rows) or
                        row_statistics(x, local, rows))
    vocab = 50257
    chunked_cross_entropy(torch.zeros(2000, vocab, dtype=torch.bfloat16, device=device),
                          torch.zeros(2000, dtype=torch.long, device=device))
    assert seen == [chunk_rows(vocab, chunk_bytes=chunk_bytes)] and chunk_bytes // (4 * vocab) in (10, 1335)


def test_reduction_must_be_mean_or_sum():
    logits, targets = _case(4, 5, torch.float32)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        chunked_cross_entropy(logits, targets, reduction="none")
