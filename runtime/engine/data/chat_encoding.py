"""Conversations -> token ids and loss-mask bytes: rendered with the tokenizer folder's chat template, encoded,
and each assistant turn's tokens marked trained.

A turn's trained text is its content as rendered plus its end-of-turn marker (runtime/tokenizer/chat/template.py
``render_with_assistant_spans``: the role header stays prompt; a template's ``{% generation %}`` blocks win where
it has them); character spans become token spans as transformers' assistant mask makes them
(runtime/tokenizer/token_spans.py). The end-of-turn markers are the folder's end-of-sequence tokens
(runtime/tokenizer/chat/end_of_turn.py: Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``, Mistral's ``</s>``...).

``encode_conversations`` runs the files through worker processes (forked, they inherit the encoder), in
batches, writing results in order: memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import math
import multiprocessing
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from runtime.engine.data.conversations import Conversation, read_conversations
from runtime.engine.data.corpus import DataError
from runtime.engine.data.loss_mask import STARTS, TRAINED
from runtime.engine.data.writers import TYPECODES, MaskWriter, TokenWriter, little_endian
from runtime.observe.progress import Progress
from runtime.tokenizer import Tokenizer, TokenizerError, char_spans_to_token_spans, load_tokenizer
from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError
from runtime.tokenizer.chat.end_of_turn import end_of_turn_markers

BATCH_CONVERSATIONS = 256  # conversations per worker task


@dataclass(frozen=True)
class ChatEncoder:
    tokenizer: Tokenizer
    template: ChatTemplate
    end_markers: tuple[str, ...]

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatEncoder:
        """The folder's tokenizer, chat template and end-of-turn markers; DataError naming what is missing."""
        try:
            tokenizer = load_tokenizer(folder)
            template = ChatTemplate.from_folder(folder)
            return cls(tokenizer, template, end_of_turn_markers(folder, tokenizer, template))
        except (TokenizerError, ChatTemplateError) as e:
            raise DataError(f"--tokenizer: {e}") from None

    def encode(self, conversation: Conversation) -> tuple[list[int], bytearray]:
        """(ids, one mask byte per id: bit 0 trained, bit 1 on the first); DataError naming the line."""
        try:
            rendering = self.template.render_with_assistant_spans(conversation.messages, end_markers=self.end_markers,
                                                                  tools=conversation.tools)
        except ChatTemplateError as e:
            raise DataError(f"{conversation.where}: {e}") from None
        ids = self.tokenizer.encode(rendering.text)
        if not ids:
            raise DataError(f"{conversation.where}: the conversation renders to no tokens")
        mask = bytearray(len(ids))
        for first, stop in char_spans_to_token_spans(self.tokenizer, rendering.text, rendering.assistant_spans, ids=ids):
            mask[first:stop] = bytes([TRAINED]) * (stop - first)
        mask[0] |= STARTS
        return ids, mask


@dataclass
class ChatWriter:
    """A token writer and the mask beside it, fed one conversation at a time."""

    tokens: TokenWriter
    mask: MaskWriter
    conversations: int = 0
    trained: int = 0

    def add(self, ids: bytes, mask: bytes) -> None:
        self.tokens.add(ids, ends_document=True)
        self.mask.add(mask)
        self.conversations += 1
        self.trained += mask.count(TRAINED) + mask.count(TRAINED | STARTS)

    def close(self) -> list[Path]:
        return self.mask.close() + self.tokens.close()  # the token files last: a Megatron .idx marks the whole

    def abort(self) -> None:
        self.tokens.abort()
        self.mask.abort()


_WORKER: dict = {}  # the encoder, set before forking (workers inherit it) or loaded by a spawned worker


def _initialize(folder: str, dtype: str) -> None:
    if _WORKER.get("folder") != folder:
        _WORKER.update(folder=folder, encoder=ChatEncoder.from_folder(folder))
    _WORKER["dtype"] = dtype


def encode_batch(batch: list[Conversation]) -> list[tuple[bytes, bytes]]:
    """Each conversation's ids (little-endian bytes of the writer's dtype) and mask bytes."""
    encoder, typecode = _WORKER["encoder"], TYPECODES[_WORKER["dtype"]]
    out = []
    for conversation in batch:
        ids, mask = encoder.encode(conversation)
        out.append((little_endian(array(typecode, ids)), bytes(mask)))
    return out


def encode_conversations(files: list[Path], *, folder: str, encoder: ChatEncoder, train: ChatWriter,
                         val: ChatWriter | None = None, val_fraction: float = 0.0, workers: int = 1,
                         progress: Progress | None = None) -> int:
    """Every conversation of ``files`` into ``train`` (every k-th into ``val`` with ``val_fraction``, spread as
    tokenize.py spreads documents); the writers are closed by the caller. Returns the input bytes read."""
    _WORKER.update(folder=folder, encoder=encoder, dtype=train.tokens.dtype)
    progress = progress or Progress("tokenize --chat", sum(f.stat().st_size for f in files))
    seen = 0
    for sizes, results in _encoded(_batches(files), folder=folder, dtype=train.tokens.dtype, workers=workers):
        for size, (ids, mask) in zip(sizes, results):
            to_val = val is not None and math.floor((seen + 1) * val_fraction) > math.floor(seen * val_fraction)
            (val if to_val else train).add(ids, mask)
            seen += 1
            progress.advance(size, len(mask))
    progress.finish()
    return progress.done


def _batches(files: list[Path]) -> Iterator[tuple[list[int], list[Conversation]]]:
    sizes, batch = [], []
    for path in files:
        for conversation, size in read_conversations(path):
            sizes.append(size)
            batch.append(conversation)
            if len(batch) == BATCH_CONVERSATIONS:
                yield sizes, batch
                sizes, batch = [], []
    if batch:
        yield sizes, batch


def _encoded(batches: Iterator[tuple[list[int], list[Conversation]]], *, folder: str, dtype: str, workers: int):
    """(line sizes, encoded conversations) of each batch, in order: here, or on ``workers`` processes (at most two
    batches each in flight). A daemonic process (a rank some launchers start) may not have children: here."""
    if workers <= 1 or multiprocessing.current_process().daemon:
        for sizes, batch in batches:
            yield sizes, encode_batch(batch)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer=_initialize, initargs=(folder, dtype)) as pool:
        pending: deque = deque()
        for sizes, batch in batches:
            pending.append((sizes, pool.apply_async(encode_batch, (batch,))))
            if len(pending) >= 2 * workers:
                sizes, result = pending.popleft()
                yield sizes, result.get()
        while pending:
            sizes, result = pending.popleft()
            yield sizes, result.get()
