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


def shard_widths(vocab_size: int, mp: int) -> list[int]:
    """The head's rows per mp rank as DTensor's Shard(0) splits them (torch.chunk: ceil(V / mp) each, the last
    ranks what is left, possibly fewer or none)."""
    size = -(-vocab_size // mp)
    return [max(0, min(size, vocab_size - r * size)) for r in range(mp)]


def head_aligned(vocab_size: int, *, mp: int, itemsize: int) -> bool:
    """Whether every mp rank's head shard is a multiple of 16 bytes (compiler/planner/devices.py ``rows_aligned``)."""
    return all(rows_aligned(w, itemsize) for w in shard_widths(vocab_size, mp) if w)


def unaligned_head_note(vocab_size: int, *, mp: int, itemsize: int, device_type: str) -> str | None:
    """A one-line note for a GPU run where some mp rank's head shard is not 16-byte aligned; None when every
    shard is aligned, and on CPU, where it costs little (a head of 50,257 rows ran 5-12% slower than one of 50,304
    on one thread here, against ~6x on a GPU)."""
    if device_type == "cpu" or head_aligned(vocab_size, mp=mp, itemsize=itemsize):
        return None
    widths = shard_widths(vocab_size, mp)
    per_rank = f"{widths[0]:,} per mp rank" + (f", {widths[-1]:,} on the last" if widths[-1] != widths[0] else "")
    return (f"note: the LM head's rows ({vocab_size:,} words, {per_rank}) are not all a multiple of 16 bytes: its "
            f"products run on unaligned GPU kernels, ~6x slower (H200, GPT-2 small: 91.9 ms per step, 64.8 ms at "
            f"--vocab-size 50304). A model trained from scratch can pad it: --vocab-size "
            f"{padded_vocabulary(vocab_size, mp)}")
