"""``--data chat.jsonl --tokenizer FOLDER``: conversations rendered and tokenized once per machine into the data
cache, as a Megatron dataset (one document per conversation) and its loss mask (loss_mask.py), keyed by the
folder's tokenizer, template and end-of-sequence files and the JSON-lines files' contents.

The first rank to take the entry's lock encodes with every core of the machine (chat_encoding.py, with a
progress line); the others wait and map the result, as for text (tokenized_text.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.data import megatron
from runtime.engine.data.cache import cache_key, exclusive
from runtime.engine.data.chat_encoding import ChatEncoder, ChatWriter, encode_conversations
from runtime.engine.data.corpus import DataError
from runtime.engine.data.loss_mask import mask_path
from runtime.engine.data.token_files import TokenFile
from runtime.engine.data.tokenized_text import content_digest, tokenizer_digest
from runtime.engine.data.writers import MaskWriter, MegatronWriter, token_dtype
from runtime.observe.progress import Progress
from runtime.tokenizer.folder import GENERATION_CONFIG

FORMAT_VERSION = 1  # part of every key: a change to how conversations become tokens makes new entries


@dataclass(frozen=True)
class TokenizedChat:
    tokens: TokenFile
    mask: Path


def tokenized_chat(files: list[Path], *, tokenizer: str, cache_dir: Path, vocab_size: int, flag: str) -> TokenizedChat:
    key = cache_key("chat", FORMAT_VERSION, tokenizer_digest(tokenizer), _chat_files_digest(tokenizer),
                    *(content_digest(f, cache_dir) for f in files))
    prefix = cache_dir / f"chat-{key}"
    with exclusive(cache_dir / f"chat-{key}.lock"):
        if not Path(f"{prefix}.idx").is_file():
            _encode(files, tokenizer=tokenizer, prefix=prefix, vocab_size=vocab_size, flag=flag)
    dataset = megatron.read_indexed_dataset(str(prefix), flag=flag)
    return TokenizedChat(dataset.tokens, mask_path(Path(f"{prefix}.bin")))


def _chat_files_digest(folder: str) -> str:
    """What renders conversations besides the tokenizer files (the template among them): the end-of-sequence ids
    that end turns."""
    path = Path(folder) / GENERATION_CONFIG
    return cache_key(path.read_bytes() if path.is_file() else b"-")


def _encode(files: list[Path], *, tokenizer: str, prefix: Path, vocab_size: int, flag: str) -> None:
    encoder = ChatEncoder.from_folder(tokenizer)
    if encoder.tokenizer.vocab_size > vocab_size:
        raise DataError(f"--tokenizer {tokenizer} has {encoder.tokenizer.vocab_size:,} tokens, more than the model's "
                        f"vocabulary (--vocab-size {vocab_size:,})")
    writer = ChatWriter(MegatronWriter(prefix, token_dtype("megatron", encoder.tokenizer.vocab_size)),
                        MaskWriter(mask_path(Path(f"{prefix}.bin"))))
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    names = files[0].name + (f" and {len(files) - 1} more" if len(files) > 1 else "")
    try:
        encode_conversations(files, folder=tokenizer, encoder=encoder, train=writer, workers=workers,
                             progress=Progress(f"{flag}: rendering and tokenizing {names} (once per machine)",
                                               sum(f.stat().st_size for f in files)))
    except BaseException:
        writer.abort()
        raise
    if writer.conversations == 0:
        writer.abort()
        raise DataError(f"{flag}: {names} holds no conversations")
    writer.close()
