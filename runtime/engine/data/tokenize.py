"""Text corpora -> token files: documents (documents.py) encoded in worker processes, written in order.

The main process reads and cuts the text (bounded: 4 MiB blocks, 1 MiB segments) and writes the ids;
``workers`` processes encode batches of about 1 MiB of text, at most two batches per worker in flight,
so memory stays the same whatever the corpus size. Workers are forked (they inherit the loaded
tokenizer; spawned where fork does not exist). With one worker everything runs in this process.

Every document gets ``eod`` after it (the tokenizer's eos unless told otherwise), and every k-th
document goes to the validation writer when ``val_fraction`` is set (document i is held out when
floor((i + 1) f) > floor(i f): spread evenly over the corpus, the same every run). Special-token text
inside documents is plain text unless ``parse_special`` (nanoGPT and llm.c encode ordinary text the
same way: tiktoken's ``encode_ordinary``).
"""

from __future__ import annotations

import math
import multiprocessing
import re
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from runtime.engine.data.documents import Segment, read_segments
from runtime.engine.data.writers import TYPECODES, TokenWriter, little_endian
from runtime.observe.progress import Progress
from runtime.tokenizer import Tokenizer, load_tokenizer
from runtime.tokenizer.segments import cut_pattern

BYTES = "bytes"  # --tokenizer bytes: the UTF-8 bytes are the ids (the engine's byte-level models)
BATCH_CHARS = 1 << 20  # text per worker task
SEGMENT_CHARS = 1 << 20  # a longer document is cut (exactly) into segments of about this size


@dataclass(frozen=True)
class EncodeSettings:
    tokenizer: str  # a tokenizer folder, or BYTES
    dtype: str  # a writers.TYPECODES name
    eod: int | None
    parse_special: bool = False


@dataclass(frozen=True)
class TokenizeResult:
    documents: int
    tokens: int
    val_documents: int
    val_tokens: int
    input_bytes: int
    seconds: float


# The worker's tokenizer and settings: set in the parent before forking, so workers inherit them.
_WORKER: dict = {}


def load(settings_tokenizer: str) -> Tokenizer | None:
    return None if settings_tokenizer == BYTES else load_tokenizer(settings_tokenizer)


def _initialize(settings: EncodeSettings) -> None:
    if _WORKER.get("settings") != settings:  # spawned, or a different job: load it here
        _WORKER.update(settings=settings, tokenizer=load(settings.tokenizer))


def encode_batch(batch: list[tuple[str, bool, bool]]) -> list[bytes]:
    """[(text, continued, ends_document)] -> each segment's ids as little-endian bytes of the dtype."""
    settings, tokenizer = _WORKER["settings"], _WORKER["tokenizer"]
    out = []
    for text, continued, ends in batch:
        tail = [settings.eod] if ends and settings.eod is not None else []
        if tokenizer is None:
            out.append(_widened(text.encode("utf-8"), array(TYPECODES[settings.dtype]).itemsize) + little_endian(
                array(TYPECODES[settings.dtype], tail)))
            continue
        ids = array(TYPECODES[settings.dtype])
        ids.fromlist(tokenizer.encode(text, split_special_tokens=not settings.parse_special, continued=continued) + tail)
        out.append(little_endian(ids))
    return out


def _widened(data: bytes, itemsize: int) -> bytes:
    """Bytes as little-endian ids of ``itemsize`` bytes each, by a strided copy (no Python int per byte)."""
    wide = bytearray(len(data) * itemsize)
    wide[0::itemsize] = data
    return bytes(wide)


def tokenize_files(files: list[Path], settings: EncodeSettings, *, train: TokenWriter, val: TokenWriter | None = None,
                   val_fraction: float = 0.0, text_key: str = "text", split_documents: bool = False,
                   workers: int = 1, tokenizer: Tokenizer | None = None, progress: Progress | None = None) -> TokenizeResult:
    """Encode ``files`` into the writers (which the caller closes). ``tokenizer``: the loaded one, if any."""
    if tokenizer is None:
        tokenizer = load(settings.tokenizer)
    _WORKER.update(settings=settings, tokenizer=tokenizer)
    cut = cut_pattern(tokenizer) if tokenizer is not None else re.compile("(?=.)", re.DOTALL)  # bytes: any cut is exact
    segments = read_segments(files, text_key=text_key, split_documents=split_documents, cut=cut,
                             segment_chars=SEGMENT_CHARS)
    progress = progress or Progress("tokenize", sum(f.stat().st_size for f in files))
    documents = val_documents = 0
    to_val, itemsize = False, array(TYPECODES[settings.dtype]).itemsize
    for batch, results in _encoded(_batches(segments), settings, workers=workers):
        for segment, ids in zip(batch, results):
            if not segment.continued and (segment.text or segment.ends_document):
                to_val = val is not None and math.floor((documents + 1) * val_fraction) > math.floor(documents * val_fraction)
                documents += 1
                val_documents += to_val
            if segment.text or segment.ends_document:
                (val if to_val else train).add(ids, ends_document=segment.ends_document)
            progress.advance(segment.input_bytes, len(ids) // itemsize)
    seconds = progress.finish()
    val_tokens = val.tokens if val is not None else 0
    return TokenizeResult(documents - val_documents, train.tokens, val_documents, val_tokens, progress.done, seconds)


def _batches(segments: Iterator[Segment]) -> Iterator[list[Segment]]:
    batch, size = [], 0
    for segment in segments:
        batch.append(segment)
        size += len(segment.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(batches: Iterator[list[Segment]], settings: EncodeSettings, *, workers: int):
    """(batch, its segments' ids) in order, encoded here or by ``workers`` processes."""
    work = lambda batch: [(s.text, s.continued, s.ends_document) for s in batch]  # noqa: E731
    if workers <= 1:
        for batch in batches:
            yield batch, encode_batch(work(batch))
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer=_initialize, initargs=(settings,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(encode_batch, (work(batch),))))
            if len(pending) >= 2 * workers:
                batch, result = pending.popleft()
                yield batch, result.get()
        while pending:
            batch, result = pending.popleft()
            yield batch, result.get()
