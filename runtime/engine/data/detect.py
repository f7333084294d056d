"""What a ``--data`` / ``--val-data`` path is: text, a nanoGPT .bin, llm.c shards or a Megatron pair.

With ``--data-format auto`` (the default) the name and the first bytes decide, never the content's
statistics, so a token file is never trained on as text:

- ``builtin``; a glob (``*``, ``?``, ``[``): llm.c shards
- ``NAME``, ``NAME.bin`` or ``NAME.idx`` with both ``NAME.bin`` and ``NAME.idx`` present: Megatron
- a ``.bin`` file: an llm.c shard if it starts with an llm.c magic or is named ``*_train_*`` / ``*_val_*``
  (its header is then checked), else nanoGPT token ids of ``--token-dtype``
- a ``.txt`` file: UTF-8 text (byte-level; with a tokenizer, tokenized once into the cache: tokenized_text.py)
- a ``.jsonl`` (``.json``, ``.ndjson``) file whose first record has ``messages`` or ``prompt``: chat data,
  rendered and tokenized once into the cache with the tokenizer folder's chat template (tokenized_chat.py)
- a folder: its ``*.bin`` llm.c shards; else its nanoGPT ``train.bin`` (and ``val.bin``); else its ``.txt`` files
- anything else: an error asking for ``--data-format``.

A nanoGPT or Megatron token file with a loss mask beside it (``NAME.mask``: loss_mask.py, what ``tokenize --chat``
writes) is chat data too: the loss trains on the tokens its mask marks (``Source.masks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.engine.data import llmc, megatron
from runtime.engine.data.conversations import looks_like_chat, not_chat_data
from runtime.engine.data.corpus import DataError, IndexedDocuments
from runtime.engine.data.documents import JSON_LINES_SUFFIXES
from runtime.engine.data.loss_mask import mask_path
from runtime.engine.data.text import TEXT_SUFFIXES, builtin_tokens, text_files, text_tokens, writable_cache
from runtime.engine.data.token_files import TokenFile, nanogpt_file
from runtime.engine.data.tokenized_text import tokenized_text

DATA_FORMATS = ("auto", "text", "nanogpt", "llmc", "megatron", "chat")
_VALID = ("builtin, synthetic, a UTF-8 .txt file or a folder of them, chat JSON lines (.jsonl), a nanoGPT .bin "
          "(--token-dtype), llm.c shards (a file, a folder or a glob), a Megatron NAME.bin/NAME.idx pair (the prefix "
          "or either file), or a mixture 0.7:PATH,0.3:PATH")


@dataclass(frozen=True)
class Source:
    kind: str  # "builtin", "text", "tokenized", "chat", "nanogpt", "llmc" or "megatron"
    train: list[TokenFile]
    val: list[TokenFile] | None  # the validation split the format itself names (llm.c _val_ shards, nanoGPT val.bin)
    byte_level: bool  # the tokens are UTF-8 bytes
    documents: IndexedDocuments | None = None  # Megatron's document index of train[0]
    masks: dict[Path, Path] | None = None  # chat data: each token file's loss mask (loss_mask.py)

    def describe(self) -> str:
        n = sum(f.count for f in self.train)
        what = {"builtin": "builtin: pydoc_data.topics", "text": "UTF-8 text", "tokenized": "tokenized text",
                "chat": "chat JSON lines", "nanogpt": "nanoGPT tokens", "llmc": "llm.c shards",
                "megatron": "Megatron indexed dataset"}[self.kind]
        what += " with loss masks" if self.masks and self.kind != "chat" else ""
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
        return _with_masks(Source("megatron", [dataset.tokens], None, byte_level=False, documents=dataset.documents),
                           flag=flag)
    if fmt == "llmc":
        return _llmc(spec, flag=flag)
    path = _existing(spec, flag=flag)
    if fmt == "chat":
        return _chat(chat_files(path, flag=flag), tokenizer, cache_dir, vocab_size, flag)
    if fmt == "nanogpt":
        if path.is_dir():
            path = path / "train.bin"
        val = path.with_name("val.bin") if path.name == "train.bin" else None
        return _with_masks(Source("nanogpt", [nanogpt_file(_existing(str(path), flag=flag), dtype=token_dtype, flag=flag)],
                                  [nanogpt_file(val, dtype=token_dtype, flag=flag)] if val and val.is_file() else None,
                                  byte_level=False), flag=flag)
    if tokenizer:
        return _tokenized(text_files(path, flag=flag), tokenizer, cache_dir, vocab_size, flag)
    return Source("text", [text_tokens(text_files(path, flag=flag), cache_dir)], None, byte_level=True)


def _tokenized(files: list[Path], tokenizer: str, cache_dir: Path, vocab_size: int, flag: str) -> Source:
    dataset = tokenized_text(files, tokenizer=tokenizer, cache_dir=writable_cache(cache_dir), vocab_size=vocab_size, flag=flag)
    return Source("tokenized", [dataset.tokens], None, byte_level=False, documents=dataset.documents)


def _chat(files: list[Path], tokenizer: str | None, cache_dir: Path, vocab_size: int, flag: str) -> Source:
    if not tokenizer:
        raise DataError(f"{flag} {files[0]}: chat data is rendered with a chat template: give --tokenizer FOLDER (a "
                        f"tokenizer.json and a chat template), or --init-from a model folder that has them")
    from runtime.engine.data.tokenized_chat import tokenized_chat  # the chat template renderer loads for chat data only

    chat = tokenized_chat(files, tokenizer=tokenizer, cache_dir=writable_cache(cache_dir), vocab_size=vocab_size, flag=flag)
    return Source("chat", [chat.tokens], None, byte_level=False, masks={chat.tokens.path: chat.mask})


def chat_files(path: Path, *, flag: str) -> list[Path]:
    """A chat JSON-lines file, or every one under a folder, sorted."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix.lower() in JSON_LINES_SUFFIXES)
    if not files:
        raise DataError(f"{flag} {path}: the folder holds no JSON-lines files ({', '.join(JSON_LINES_SUFFIXES)})")
    return files


def _with_masks(src: Source, *, flag: str) -> Source:
    """``src`` with the loss masks beside its token files (chat data), when they are there: all or none."""
    files = src.train + (src.val or [])
    found = {f.path: mask_path(f.path) for f in files if mask_path(f.path).is_file()}
    if not found:
        return src
    missing = [f.path for f in files if f.path not in found]
    if missing:
        raise DataError(f"{flag} {missing[0]}: no loss mask {mask_path(missing[0]).name} beside it, but "
                        f"{next(iter(found.values()))} is there: chat data needs a mask beside every token file")
    return Source(src.kind, src.train, src.val, src.byte_level, src.documents, masks=found)


def is_chat_data(spec: str, *, data_format: str) -> bool | None:
    """Whether ``spec`` (one path, not a mixture) names chat data: JSON lines of conversations, or token files with
    loss masks. None where it cannot tell (the data's own checks say why later)."""
    if spec in ("builtin", "synthetic") or data_format in ("text", "llmc"):
        return False
    try:
        fmt = data_format if data_format != "auto" else _guess(spec, flag="--data")
    except DataError:
        return None
    if fmt == "chat":
        return True
    if fmt == "megatron":
        prefix = megatron.prefix_of(spec)
        return prefix is not None and mask_path(Path(f"{prefix}.bin")).is_file()
    if fmt == "nanogpt":
        path = Path(spec) / "train.bin" if Path(spec).is_dir() else Path(spec)
        return mask_path(path).is_file()
    return False


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
        if (path / "train.bin").is_file():
            return "nanogpt"
        chats = [p for p in sorted(path.rglob("*")) if p.suffix.lower() in JSON_LINES_SUFFIXES]
        return "chat" if chats and not any(path.rglob("*.txt")) and looks_like_chat(chats[0]) else "text"
    if path.suffix == ".bin":
        return "llmc" if llmc.has_llmc_magic(path) or llmc.looks_like_shard(path) else "nanogpt"
    if path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    if path.suffix.lower() in JSON_LINES_SUFFIXES:
        if looks_like_chat(path):
            return "chat"
        raise not_chat_data(path, flag=flag)
    raise DataError(f"{flag} {spec}: cannot tell text from token ids by the name; name it .txt (UTF-8 text), .jsonl "
                    f"(conversations: {{\"messages\": [...]}} per line) or .bin (token ids), or give --data-format text, "
                    f"nanogpt, llmc, megatron or chat")


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
