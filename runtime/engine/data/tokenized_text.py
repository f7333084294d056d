"""``--data corpus.txt --tokenizer FOLDER``: text tokenized once per machine into a Megatron dataset in the
data cache, keyed by the tokenizer's files and the text files' contents.

Each text file is one document, followed by the tokenizer's eos; the dataset's index gives the document
boundaries (so ``--document-mask`` needs no ``--eod-token``). The first rank to take the entry's lock
tokenizes with every core of the machine (tokenize.py, with a progress line); the others wait and map
the result, as for byte-level text (cache.py). A file's content hash is itself cached under the file's
identity (path, size, mtime), so a later run hashes nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from runtime.engine.data import megatron
from runtime.engine.data.cache import cache_key, exclusive, file_identity, write_atomically
from runtime.engine.data.corpus import DataError
from runtime.engine.data.tokenize import EncodeSettings, tokenize_files
from runtime.engine.data.writers import MegatronWriter, token_dtype
from runtime.observe.progress import Progress
from runtime.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer, special_ids

FORMAT_VERSION = 1  # part of every key: a change to how text becomes a dataset makes new entries


def tokenized_text(files: list[Path], *, tokenizer: str, cache_dir: Path, vocab_size: int,
                   flag: str) -> megatron.IndexedDataset:
    key = cache_key("tokenized", FORMAT_VERSION, tokenizer_digest(tokenizer),
                    *(content_digest(f, cache_dir) for f in files))
    prefix = cache_dir / f"tokens-{key}"
    with exclusive(cache_dir / f"tokens-{key}.lock"):
        if not Path(f"{prefix}.idx").is_file():
            _tokenize(files, tokenizer=tokenizer, prefix=prefix, vocab_size=vocab_size, flag=flag)
    return megatron.read_indexed_dataset(str(prefix), flag=flag)


def tokenizer_digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\0")
    return h.hexdigest()


def content_digest(path: Path, cache_dir: Path) -> str:
    """sha256 of the file's bytes, remembered under its identity."""
    memo = cache_dir / f"sha256-{cache_key(file_identity(path))}"
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    write_atomically(memo, lambda out: out.write(h.hexdigest().encode()))
    return h.hexdigest()


def _tokenize(files: list[Path], *, tokenizer: str, prefix: Path, vocab_size: int, flag: str) -> None:
    try:
        loaded = load_tokenizer(tokenizer)
        eos = special_ids(tokenizer, loaded).eos
    except TokenizerError as e:
        raise DataError(f"--tokenizer: {e}") from None
    if loaded.vocab_size > vocab_size:
        raise DataError(f"--tokenizer {tokenizer} has {loaded.vocab_size:,} tokens, more than the model's vocabulary "
                        f"(--vocab-size {vocab_size:,})")
    dtype = token_dtype("megatron", loaded.vocab_size)
    writer = MegatronWriter(prefix, dtype)
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    names = files[0].name + (f" and {len(files) - 1} more" if len(files) > 1 else "")
    try:
        tokenize_files(files, EncodeSettings(tokenizer, dtype, eos), train=writer, workers=workers, tokenizer=loaded,
                       progress=Progress(f"{flag}: tokenizing {names} (once per machine)", sum(f.stat().st_size for f in files)))
    except BaseException:
        writer.abort()
        raise
    if writer.documents == 0:
        writer.abort()
        raise DataError(f"{flag}: {names} holds no text to tokenize")
    writer.close()
