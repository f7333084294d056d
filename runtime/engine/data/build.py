"""``--data`` and ``--val-data`` -> the run's training and validation batches, checked before any process group.

Validation data, in order of preference: ``--val-data``; the split the format names (llm.c ``*_val_*``
shards, nanoGPT ``val.bin`` beside ``train.bin``); else the last ``--val-fraction`` of the tokens (of the
conversations, for chat data). A mixture validates on the same mixture of its sources' validation data.

Chat data (conversations with loss masks: detect.py) becomes windows of whole conversations (chat_corpus.py);
it mixes only with chat data, since its loss is a mean over the assistant tokens alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from runtime.config import DataConfig
from runtime.engine.data.batches import Component, CorpusBatches, SyntheticBatches
from runtime.engine.data.cache import default_cache_dir
from runtime.engine.data.chat_corpus import Counts, PackingOptions, packed_corpora
from runtime.engine.data.corpus import Corpus, DataError, EodDocuments, TokenSpan, hold_out_tail
from runtime.engine.data.detect import Source, open_source
from runtime.engine.data.packed import PackedCorpus
from runtime.engine.data.text import BYTE_VOCAB
from runtime.engine.data.token_files import check_vocabulary, scan


@dataclass
class DataSources:
    train: CorpusBatches | SyntheticBatches
    val: CorpusBatches | SyntheticBatches
    description: str
    byte_level: bool = False  # tokens are UTF-8 bytes: bits per byte = loss / ln 2
    names: list[str] = field(default_factory=list)  # the mixture's sources, in --data order
    chat: bool = False  # conversations: the loss trains on assistant tokens (CorpusBatches.loss_mask)


def parse_mixture(spec: str, *, flag: str) -> list[tuple[Fraction, str]]:
    """``"0.7:A,0.3:B"`` -> [(7/10, "A"), (3/10, "B")]; a plain path is a mixture of one."""
    items = spec.split(",")
    if len(items) == 1 and _weight(items[0]) is None:
        return [(Fraction(1), spec)]
    parsed = []
    for item in items:
        weight = _weight(item)
        if weight is None or weight <= 0:
            raise DataError(f"{flag} {spec}: mixture item {item!r} must be WEIGHT:PATH with a positive weight, "
                            f"e.g. {flag} 0.7:web.bin,0.3:code.bin")
        parsed.append((weight, item.split(":", 1)[1]))
    return parsed


def _weight(item: str) -> Fraction | None:
    head, sep, _ = item.partition(":")
    if not sep:
        return None
    try:
        return Fraction(head.strip())
    except (ValueError, ZeroDivisionError):
        return None


def build_data(source: str, *, vocab_size: int, seq_len: int, global_batch_size: int, seed: int,
               val_fraction: float, val_source: str | None = None, token_dtype: str = "uint16",
               data_format: str = "auto", eod_token: int | None = None, document_mask: bool = False,
               cache_dir: Path | None = None, tokenizer: str | None = None,
               packing: PackingOptions | None = None) -> DataSources:
    """Raises DataError (before any process group exists) when the data is unusable. ``packing``: how chat data
    fills windows (default: packed, long conversations truncated)."""
    if source == "synthetic":
        if val_source is not None:
            raise DataError("--val-data needs real --data: synthetic tokens have no held-out text to validate on")
        if document_mask and eod_token is None:
            raise DataError("--document-mask with --data synthetic needs --eod-token ID: random tokens have no "
                            "other document boundaries")
        make = lambda s: SyntheticBatches(vocab_size=vocab_size, seq_len=seq_len, global_batch_size=global_batch_size,  # noqa: E731
                                          seed=s, eod=eod_token)
        return DataSources(make(seed), make(seed + 1), f"synthetic: seeded uniform tokens over {vocab_size}")
    cache_dir = cache_dir or default_cache_dir()
    reader = _Reader(vocab_size=vocab_size, seq_len=seq_len, eod_token=eod_token, token_dtype=token_dtype,
                     data_format=data_format, cache_dir=cache_dir, document_mask=document_mask, tokenizer=tokenizer,
                     packing=packing or PackingOptions(seq_len))
    train, val, notes = [], [], []
    for weight, spec in parse_mixture(source, flag="--data"):
        src = reader.open(spec, flag="--data")
        if src.masks is not None:
            corpus, val_corpus, note = reader.chat(src, spec=spec, hold_out=val_fraction if val_source is None else None,
                                                   flag="--data")
            train.append(Component(spec, weight, corpus))
            val.extend([Component(spec, weight, val_corpus)] if val_corpus else [])
            notes.append(note)
            continue
        spans = reader.spans(src, src.train, flag="--data")
        if val_source is None and src.val:
            val_spans, where = reader.spans(src, src.val, flag="--data"), "its validation files"
        elif val_source is None:
            spans, val_spans = _held_out(spans, fraction=val_fraction, seq_len=seq_len, spec=spec)
            where = f"the last {val_fraction:.0%} of the tokens"
        else:
            val_spans, where = [], ""
        train.append(Component(spec, weight, reader.corpus(spans, spec=spec, flag="--data")))
        if val_spans:
            val.append(Component(spec, weight, reader.corpus(val_spans, spec=spec, flag="--data")))
        notes.append((f"{spec}: " if spec != "builtin" else "") + src.describe() + (f", validation on {where}" if where else ""))
    if val_source is not None:
        for weight, spec in parse_mixture(val_source, flag="--val-data"):
            src = reader.open(spec, flag="--val-data")
            corpus = (reader.packed(src, src.train + (src.val or []), spec=spec, flag="--val-data")[0]
                      if src.masks is not None else
                      reader.corpus(reader.spans(src, src.train + (src.val or []), flag="--val-data"), spec=spec,
                                    flag="--val-data"))
            val.append(Component(spec, weight, corpus))
        notes.append(f"validation: --val-data {val_source}")
    chat = _same_kind(train + val, source=source, val_source=val_source)
    batches = lambda parts, s: CorpusBatches(parts, global_batch_size=global_batch_size, seed=s)  # noqa: E731
    epoch = " + ".join(f"{c.corpus.windows:,}" for c in train)
    description = "; ".join(notes) + f"; an epoch is {epoch} windows of {seq_len} + 1 tokens"
    return DataSources(batches(train, seed), batches(val, seed + 1), description, byte_level=reader.byte_level,
                       names=[c.name for c in train], chat=chat)


def _same_kind(components: list[Component], *, source: str, val_source: str | None) -> bool:
    """Whether the data is chat data; DataError where chat data and plain tokens meet (one mean over assistant
    tokens, the other over every token: no one loss covers both)."""
    chat = [isinstance(c.corpus, PackedCorpus) for c in components]
    if any(chat) and not all(chat):
        where = f"--data {source}" + (f" and --val-data {val_source}" if val_source else "")
        raise DataError(f"{where} mix chat data (loss on assistant tokens) with plain tokens; train and validate on "
                        f"one kind")
    return any(chat)


def build_data_from_config(data: DataConfig, *, vocab_size: int, seq_len: int, global_batch_size: int,
                           seed: int) -> DataSources:
    """``build_data`` with the run's data flags."""
    return build_data(data.source, vocab_size=vocab_size, seq_len=seq_len, global_batch_size=global_batch_size,
                      seed=seed, val_fraction=data.val_fraction, val_source=data.val_source,
                      token_dtype=data.token_dtype, data_format=data.data_format, eod_token=data.eod_token,
                      document_mask=data.document_mask, tokenizer=data.tokenizer,
                      packing=packing_options(data, seq_len=seq_len))


def packing_options(data: DataConfig, *, seq_len: int) -> PackingOptions:
    """How the run's chat data fills windows of ``seq_len`` + 1 tokens."""
    return PackingOptions(seq_len, long_conversations=data.long_conversations, packing=data.packing)


def evaluation_corpus(spec: str, *, vocab_size: int, seq_len: int, token_dtype: str = "uint16",
                      data_format: str = "auto", cache_dir: Path | None = None, eod_token: int | None = None,
                      document_mask: bool = False, tokenizer: str | None = None,
                      packing: PackingOptions | None = None) -> tuple[Corpus | PackedCorpus, bool, str]:
    """What ``run.py eval --data`` evaluates: the validation split the format names (llm.c ``*_val_*`` shards,
    nanoGPT ``val.bin``), else every file ``spec`` names, whole (chat data: every conversation, packed as training
    packs). Returns (corpus, byte-level, description)."""
    if spec == "synthetic" or len(parse_mixture(spec, flag="--data")) > 1:
        raise DataError(f"--data {spec}: evaluation reads one data set (a file, a folder, a glob or a Megatron pair)")
    reader = _Reader(vocab_size=vocab_size, seq_len=seq_len, eod_token=eod_token, token_dtype=token_dtype,
                     data_format=data_format, cache_dir=cache_dir or default_cache_dir(), document_mask=document_mask,
                     tokenizer=tokenizer, packing=packing or PackingOptions(seq_len))
    src = reader.open(spec, flag="--data")
    files = src.val or src.train
    if src.masks is not None:
        corpus, counts = reader.packed(src, files, spec=spec, flag="--data")
        which = "its validation files" if src.val else "every conversation"
        return corpus, False, f"{src.describe()}: {which}: {counts.describe(corpus, reader.packing)}"
    corpus = reader.corpus(reader.spans(src, files, flag="--data"), spec=spec, flag="--data")
    which = "its validation files" if src.val else "every file"
    return corpus, src.byte_level, f"{src.describe()}: {which}, {corpus.windows:,} windows of {seq_len} + 1 tokens"


def _held_out(spans: list[TokenSpan], *, fraction: float, seq_len: int, spec: str) -> tuple[list[TokenSpan], list[TokenSpan]]:
    total = sum(len(s) for s in spans)
    need = math.ceil((seq_len + 1) / min(fraction, 1 - fraction))
    if total < need:
        raise DataError(f"--data {spec} holds {total:,} tokens, fewer than one sequence (--seq-len {seq_len} + 1) in "
                        f"both the training and the {fraction:.0%} validation split; need at least {need:,} tokens")
    return hold_out_tail(spans, fraction=fraction, need=seq_len + 1)


@dataclass
class _Reader:
    """Opens sources and checks their tokens against the model, with the run's data flags."""

    vocab_size: int
    seq_len: int
    eod_token: int | None
    token_dtype: str
    data_format: str
    cache_dir: Path
    document_mask: bool
    tokenizer: str | None = None  # a folder: text is tokenized with it
    packing: PackingOptions | None = None  # how chat data fills windows
    byte_level: bool = False

    def open(self, spec: str, *, flag: str) -> Source:
        if spec == "synthetic":
            raise DataError(f"{flag} {spec}: synthetic tokens cannot be mixed or validated on; give a path")
        src = open_source(spec, flag=flag, data_format=self.data_format, token_dtype=self.token_dtype,
                          cache_dir=self.cache_dir, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        if src.byte_level:
            self.byte_level = True
            if self.vocab_size < BYTE_VOCAB:
                raise DataError(f"--vocab-size {self.vocab_size} is too small for byte-level text ({flag} {spec}); "
                                f"use --vocab-size >= {BYTE_VOCAB} or --data synthetic")
        if self.document_mask and self.eod_token is None and src.documents is None and src.masks is None:
            raise DataError(f"--document-mask needs to know where documents end: give --eod-token ID (e.g. 50256, "
                            f"GPT-2's <|endoftext|>), or a Megatron NAME.bin/NAME.idx pair ({flag} {spec} is {src.kind})")
        return src

    def spans(self, src: Source, files: list, *, flag: str) -> list[TokenSpan]:
        """Every file's tokens, memory-mapped, after checking them against the vocabulary (one scan per file)."""
        spans = []
        for file in files:
            eods = None
            if not (src.byte_level and self.eod_token is None):  # bytes always fit a byte vocabulary
                result = scan(file, eod=self.eod_token if src.documents is None else None, cache_dir=self.cache_dir)
                check_vocabulary(file, result, vocab_size=self.vocab_size, flag=flag)
                eods = result.eods
            documents = src.documents if src.documents is not None else (EodDocuments(eods) if eods is not None else None)
            spans.append(TokenSpan(str(file.path), file.map(), 0, file.count, documents))
        return spans

    def chat(self, src: Source, *, spec: str, hold_out: float | None,
             flag: str) -> tuple[PackedCorpus, PackedCorpus | None, str]:
        """Chat data's training corpus and its validation corpus (the format's split, else the last ``hold_out``
        of the conversations, else None: --val-data), and the note describing them."""
        if src.val:
            train, counts = self.packed(src, src.train, spec=spec, flag=flag)
            val, where = self.packed(src, src.val, spec=f"{spec} (validation files)", flag=flag)[0], "its validation files"
        else:
            self._check_vocabulary(src.train, flag=flag)
            (train, counts), held = packed_corpora(src.train, src.masks, self.packing, flag=flag,
                                                   cache_dir=self.cache_dir, hold_out=hold_out, name=spec)
            val, where = (held[0], f"the last {hold_out:.0%} of the conversations") if held else (None, "")
        note = (f"{spec}: {src.describe()}: {counts.describe(train, self.packing)}"
                + (f", validation on {where}" if where else ""))
        return train, val, note

    def packed(self, src: Source, files: list, *, spec: str, flag: str) -> tuple[PackedCorpus, Counts]:
        """Every conversation of ``files`` (``spec``'s, which messages name) packed."""
        self._check_vocabulary(files, flag=flag)
        return packed_corpora(files, src.masks, self.packing, flag=flag, cache_dir=self.cache_dir, name=spec)[0]

    def _check_vocabulary(self, files: list, *, flag: str) -> None:
        for file in files:
            check_vocabulary(file, scan(file, eod=None, cache_dir=self.cache_dir), vocab_size=self.vocab_size, flag=flag)

    def corpus(self, spans: list[TokenSpan], *, spec: str, flag: str) -> Corpus:
        corpus = Corpus(tuple(spans), self.seq_len)
        if corpus.windows == 0:
            longest = max((len(s) for s in spans), default=0)
            raise DataError(f"{flag} {spec}: no file holds one sequence (--seq-len {self.seq_len} + 1 tokens); the "
                            f"longest has {longest:,} tokens")
        return corpus
