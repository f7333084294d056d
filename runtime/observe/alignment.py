"""A note at start-up when the LM head's products will run on a GPU's unaligned kernels.

The logits' rows are the vocabulary (this rank's shard of it under TP) long. Where that is not a multiple of 16
bytes, cuBLAS runs the head's forward and both gradients on kernels ~6x slower (compiler/planner/devices.py
``GpuDevice.unaligned_slowdown``, measured on an H200: GPT-2's 50,257 words). Padding the vocabulary, as nanoGPT
(50,304) and Megatron-LM (``--make-vocab-size-divisible-by``, 128 x TP) do, aligns them; the padded words are
never a target, so a model trained from scratch learns to give them no probability.
"""

from __future__ import annotations

from compiler.planner.devices import rows_aligned


def padded_vocabulary(vocab_size: int, mp: int) -> int:
    """The next multiple of 64 x mp: every shard a multiple of 64 words (16 bytes in every dtype)."""
    step = 64 * mp
    return -(-vocab_size // step) * step


def unaligned_head_note(vocab_size: int, *, mp: int, itemsize: int, device_type: str) -> str | None:
    """A one-line note for a GPU run whose head shard (ceil(V / mp) words; DTensor's uneven shards differ by
    one word at most) is not 16-byte aligned; None on CPU (its kernels do not care, measured) or when aligned."""
    shard = -(-vocab_size // mp)
    if device_type == "cpu" or (rows_aligned(shard, itemsize) and vocab_size % mp == 0):
        return None
    return (f"note: the vocabulary ({vocab_size:,} words, {shard:,} per mp rank) is not a multiple of "
            f"{16 // itemsize} values: the LM head's products run on unaligned GPU kernels, ~6x slower (H200, GPT-2 "
            f"small: 91.9 ms per step, 64.8 ms at --vocab-size 50304). A model trained from scratch can pad it: "
            f"--vocab-size {padded_vocabulary(vocab_size, mp)}")
