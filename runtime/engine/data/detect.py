"""What a ``--data`` / ``--val-data`` path is: text, a nanoGPT .bin, llm.c shards or a Megatron pair.

With ``--data-format auto`` (the default) the name and the first bytes decide, never the content's
statistics, so a token file is never trained on as text:

- ``builtin``; a glob (``*``, ``?``, ``[``): llm.c shards
- ``NAME``, ``NAME.bin`` or ``NAME.idx`` with both ``NAME.bin`` and ``NAME.idx`` present: Megatron
- a ``.bin`` file: an llm.c shard if it starts with an llm.c magic or is named ``*_train_*`` / ``*_val_*``
  (its header is then checked), else nanoGPT token ids of ``--token-dtype``
- a ``.txt`` file: UTF-8 text (byte-level; with a tokenizer, tokenized once into the cache: tokenized_text.py)
- a folder: its ``*.bin`` llm.c shards; else its nanoGPT ``train.bin`` (and ``val.bin``); else its ``.txt`` files
- anything else: an error asking for ``--data-format``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.engine.data import llmc, megatron
from runtime.engine.data.corpus import DataError, IndexedDocuments
from runtime.engine.data.text import TEXT_SUFFIXES, builtin_tokens, text_files, text_tokens, writable_cache
from runtime.engine.data.token_files import TokenFile, nanogpt_file
from runtime.engine.data.tokenized_text import tokenized_text

DATA_FORMATS = ("auto", "text", "nanogpt", "llmc", "megatron")
_VALID = ("builtin, synthetic, a UTF-8 .txt file or a folder of them, a nanoGPT .bin (--token-dtype), llm.c "
          "shards (a file, a folder or a glob), a Megatron NAME.bin/NAME.idx pair (the prefix or either file), "
          "or a mixture 0.7:PATH,0.3:PATH")


@dataclass(frozen=True)
class Source:
    kind: str  # "builtin", "text", "tokenized", "nanogpt", "llmc" or "megatron"
    train: list[TokenFile]
    val: list[TokenFile] | None  # the validation split the format itself names (llm.c _val_ shards, nanoGPT val.bin)
    byte_level: bool  # the tokens are UTF-8 bytes
    documents: IndexedDocuments | None = None  # Megatron's document index of train[0]

    def describe(self) -> str:
        n = sum(f.count for f in self.train)
        what = {"builtin": "builtin: pydoc_data.topics", "text": "UTF-8 text", "tokenized": "tokenized text",
                "nanogpt": "nanoGPT tokens", "llmc": "llm.c shards", "megatron": "Megatron indexed dataset"}[self.kind]
        files = f"{len(self.train)} file(s)" if self.kind != "builtin" else "byte-level"
        val = f", {len(self.val)} validation file(s)" if self.val else ""
        return f"{what} ({files}, {n:,} {self.train[0].dtype} tokens{val})"


def open_source(spec: str, *, flag: str, data_format: str, token_dtype: str, cache_dir: Path,
                tokenizer: str | None = None, vocab_size: int = 0) -> Source:
    """Raises DataError naming ``flag`` and the file when ``spec`` cannot be read as asked. With a
    ``tokenizer`` folder, text (and the builtin text) is tokenized with it instead of read as bytes."""
    if spec == "builtin":
        if tokenizer:
            return _tokenized([builtin_tokens(cache_dir).path], tokenizer, cache_dir, vocab_size, flag)
        return Source("builtin", [builtin_tokens(cache_dir)], None, byte_level=True)
    fmt = data_format if data_format != "auto" else _guess(spec, flag=flag)
    if fmt == "megatron":
        prefix = megatron.prefix_of(spec)
        if prefix is None:
            raise DataError(f"{flag} {spec}: no Megatron NAME.bin and NAME.idx pair there")
        dataset = megatron.read_indexed_dataset(prefix, flag=flag)
        return Source("megatron", [dataset.tokens], None, byte_level=False, documents=dataset.documents)
    if fmt == "llmc":
        return _llmc(spec, flag=flag)
    path = _existing(spec, flag=flag)
    if fmt == "nanogpt":
        if path.is_dir():
            path = path / "train.bin"
        val = path.with_name("val.bin") if path.name == "train.bin" else None
        return Source("nanogpt", [nanogpt_file(_existing(str(path), flag=flag), dtype=token_dtype, flag=flag)],
                      [nanogpt_file(val, dtype=token_dtype, flag=flag)] if val and val.is_file() else None,
                      byte_level=False)
    if tokenizer:
        return _tokenized(text_files(path, flag=flag), tokenizer, cache_dir, vocab_size, flag)
    return Source("text", [text_tokens(text_files(path, flag=flag), cache_dir)], None, byte_level=True)


def _tokenized(files: list[Path], tokenizer: str, cache_dir: Path, vocab_size: int, flag: str) -> Source:
    dataset = tokenized_text(files, tokenizer=tokenizer, cache_dir=writable_cache(cache_dir), vocab_size=vocab_size, flag=flag)
    return Source("tokenized", [dataset.tokens], None, byte_level=False, documents=dataset.documents)


def _guess(spec: str, *, flag: str) -> str:
    if any(c in spec for c in "*?["):
        return "llmc"
    if megatron.prefix_of(spec):
        return "megatron"
    path = _existing(spec, flag=flag)
    if path.is_dir():
        bins = sorted(path.glob("*.bin"))
        if any(llmc.has_llmc_magic(b) or llmc.looks_like_shard(b) for b in bins):
            return "llmc"
        return "nanogpt" if (path / "train.bin").is_file() else "text"
    if path.suffix == ".bin":
        return "llmc" if llmc.has_llmc_magic(path) or llmc.looks_like_shard(path) else "nanogpt"
    if path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    raise DataError(f"{flag} {spec}: cannot tell text from token ids by the name; name it .txt (UTF-8 text) or "
                    f".bin (token ids), or give --data-format text, nanogpt, llmc or megatron")


def _llmc(spec: str, *, flag: str) -> Source:
    if any(c in spec for c in "*?["):
        files = llmc.expand(spec)
        if not files:
            raise DataError(f"{flag} {spec}: the glob matches no files")
        train, val = llmc.split_shards(files)
    else:
        path = _existing(spec, flag=flag)
        if path.is_dir():
            train, val = llmc.split_shards(sorted(path.glob("*.bin")))
            if not train:
                raise DataError(f"{flag} {spec}: the folder holds no .bin llm.c shards")
        else:
            train, val = [path], llmc.sibling_val_shards(path)
    return Source("llmc", [llmc.read_shard(f, flag=flag) for f in train],
                  [llmc.read_shard(f, flag=flag) for f in val] or None, byte_level=False)


def _existing(spec: str, *, flag: str) -> Path:
    path = Path(spec)
    if not path.exists():
        raise DataError(f"{flag} {spec}: no such file or folder (valid: {_VALID})")
    return path
