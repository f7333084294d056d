"""Token data: real text with no download, a user's text files, or seeded random tokens.

Text is tokenised at the byte level (vocabulary 256): UTF-8 bytes are the tokens. ``builtin`` is the
English documentation bundled with CPython (``pydoc_data.topics``, ~750 KB), so training on real text
needs nothing from the network.

Batches are drawn without state: the rows of global batch ``step`` come from a generator seeded by
(seed, step). DP replica d takes rows [d*B/dp, (d+1)*B/dp): replicas read disjoint, deterministic
shards of the same global batch, and PP / MP peers of a replica draw identical rows. A single
process given the whole global batch therefore sees exactly what the mesh sees.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

BYTE_VOCAB = 256


class DataError(ValueError):
    """Unusable --data; the message names the flag and the problem."""


@dataclass(frozen=True)
class TokenSplits:
    train: torch.Tensor  # (N_train,) uint8 byte tokens
    val: torch.Tensor  # (N_val,)
    description: str


def load_text_tokens(source: str, *, cache_dir: Path | None = None) -> tuple[torch.Tensor, str]:
    """Byte tokens of ``builtin`` or of a UTF-8 file / folder of ``*.txt`` files (cached as a token file)."""
    if source == "builtin":
        import pydoc_data.topics as topics

        text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
        data = text.encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), f"builtin: pydoc_data.topics ({len(data):,} bytes)"
    path = Path(source)
    if not path.exists():
        raise DataError(f"--data {source}: no such file or folder (valid: builtin, synthetic, or a path to "
                        f"a UTF-8 text file or a folder of .txt files)")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() == ".txt")
    if not files:
        raise DataError(f"--data {source}: the folder holds no .txt files")
    cache = _cache_path(files, cache_dir or _default_cache_dir())
    if not cache.exists():
        _write_token_file(files, cache)
    tokens = torch.from_file(str(cache), shared=False, size=cache.stat().st_size, dtype=torch.uint8)
    return tokens, f"{source} ({len(files)} file(s), {len(tokens):,} byte tokens, cache {cache})"


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid_engine" / "tokens"


def _cache_path(files: list[Path], cache_dir: Path) -> Path:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return cache_dir / f"{h.hexdigest()[:24]}.u8"


def _write_token_file(files: list[Path], cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    chunks = []
    for f in files:
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"--data: {f} is not UTF-8 text (invalid byte at offset {e.start})") from None
        chunks.append(raw)
    # Several ranks may tokenise at once: write privately, publish with an atomic rename.
    fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as out:
        out.write(b"\n".join(chunks))
    os.replace(tmp, cache)


def split_tokens(tokens: torch.Tensor, *, val_fraction: float, seq_len: int, description: str, source: str) -> TokenSplits:
    """Hold out the last ``val_fraction`` of the tokens; both parts must hold one sequence + 1 target."""
    need = math.ceil((seq_len + 1) / min(val_fraction, 1 - val_fraction))
    if len(tokens) < need:
        raise DataError(
            f"--data {source} holds {len(tokens):,} tokens, fewer than one sequence (--seq-len {seq_len} + 1) in "
            f"both the training and the {val_fraction:.0%} validation split; need at least {need:,} tokens"
        )
    n_val = max(seq_len + 1, int(len(tokens) * val_fraction))
    return TokenSplits(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:], description)


class TextBatches:
    """Global batch ``step``: B windows of T+1 tokens at seeded random offsets."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch_size: int, seed: int):
        self.tokens, self.seq_len, self.global_batch_size, self.seed = tokens, seq_len, global_batch_size, seed

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of global batch ``step`` as int64 (stop - start, T + 1)."""
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        offsets = torch.randint(0, len(self.tokens) - self.seq_len, (self.global_batch_size,), generator=g)
        window = torch.arange(self.seq_len + 1)
        return self.tokens[offsets[start:stop, None] + window].long()


class SyntheticBatches:
    """Seeded uniform random tokens, for benchmarks: no file, no tokenisation cost."""

    def __init__(self, *, vocab_size: int, seq_len: int, global_batch_size: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch_size, self.seed = vocab_size, seq_len, global_batch_size, seed

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        return torch.randint(0, self.vocab_size, (self.global_batch_size, self.seq_len + 1), generator=g)[start:stop]


def _mix(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) & 0x7FFFFFFFFFFFFFFF


def replica_rows(global_batch_size: int, dp_rank: int, dp: int) -> tuple[int, int]:
    per = global_batch_size // dp
    return dp_rank * per, (dp_rank + 1) * per


def inputs_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) tokens -> inputs (B, T) and next-token targets (B, T)."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@dataclass
class DataSources:
    train: TextBatches | SyntheticBatches
    val: TextBatches | SyntheticBatches
    description: str


def build_data(source: str, *, vocab_size: int, seq_len: int, global_batch_size: int, seed: int,
               val_fraction: float) -> DataSources:
    """Raises DataError (before any process group exists) when --data is unusable."""
    if source == "synthetic":
        make = lambda s: SyntheticBatches(vocab_size=vocab_size, seq_len=seq_len, global_batch_size=global_batch_size, seed=s)
        return DataSources(make(seed), make(seed + 1), f"synthetic: seeded uniform tokens over {vocab_size}")
    if vocab_size < BYTE_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is too small for byte-level text (--data {source}); "
                        f"use --vocab-size >= {BYTE_VOCAB} or --data synthetic")
    tokens, description = load_text_tokens(source)
    splits = split_tokens(tokens, val_fraction=val_fraction, seq_len=seq_len, description=description, source=source)
    return DataSources(
        TextBatches(splits.train, seq_len=seq_len, global_batch_size=global_batch_size, seed=seed),
        TextBatches(splits.val, seq_len=seq_len, global_batch_size=global_batch_size, seed=seed + 1),
        description,
    )
