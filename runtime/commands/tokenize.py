"""``python run.py tokenize``: text corpora -> the token files ``--data`` trains on.

    python run.py tokenize --tokenizer ~/models/Llama-3.2-1B corpus/ --out data/corpus --format megatron
    python run.py tokenize --tokenizer gpt2-folder web.jsonl --out data/web --format nanogpt --val-fraction 0.005
    python run.py tokenize --tokenizer bytes notes.txt --out data/notes --format llmc      # byte-level ids
    python run.py tokenize --chat --tokenizer ~/models/Qwen3-0.6B chat.jsonl --out data/chat --val-fraction 0.01

Inputs are text files (one document each, or one per blank-line block with ``--split-documents``),
JSON-lines files (one document per line, the string under ``--text-key``), folders and quoted globs.
After every document comes ``--eod-id`` (default: the tokenizer's eos). ``--val-fraction`` holds out
every k-th document, written as each format names its validation data. The id dtype follows the
vocabulary as each format's own tools choose it. ``--workers`` processes encode (default: every core);
a progress line shows MB/s and the ETA; memory stays flat whatever the corpus size
(runtime/engine/data/tokenize.py). The last line printed is JSON.

``--chat`` reads JSON lines of conversations instead (runtime/engine/data/conversations.py), renders each with
the tokenizer folder's chat template and writes its ids (no end-of-document id: the template ends each turn)
plus a loss-mask file beside each token file (``NAME.mask``: a byte per token, bit 0 an assistant token, bit 1
a conversation's first; runtime/engine/data/loss_mask.py), nanoGPT or Megatron: llm.c's fixed-size shards would
cut conversations. ``--data`` trains on them as on the JSON lines themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from runtime.commands.flags import HelpFormatter
from runtime.config import ConfigError
from runtime.engine.data import DataError
from runtime.engine.data.chat_encoding import ChatEncoder, ChatWriter, encode_conversations
from runtime.engine.data.documents import expand_inputs
from runtime.engine.data.loss_mask import mask_path
from runtime.engine.data.tokenize import BYTES, EncodeSettings, TokenizeResult, load, tokenize_files
from runtime.engine.data.writers import (
    FORMATS,
    LLMC_SHARD_TOKENS,
    LlmcWriter,
    MaskWriter,
    MegatronWriter,
    NanoGPTWriter,
    token_dtype,
)
from runtime.observe.progress import Progress
from runtime.tokenizer import TokenizerError, special_ids


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see run.py tokenize --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run.py tokenize", formatter_class=HelpFormatter, description=(
        "Tokenize text into the token files --data reads: nanoGPT train.bin / val.bin, llm.c shards or a Megatron "
        "indexed dataset. The last line printed is JSON."))
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, JSON-lines files (.jsonl, .json, .ndjson), folders of them, or quoted globs")
    p.add_argument("--tokenizer", required=True, metavar="FOLDER",
                   help="a Hugging Face tokenizer folder (tokenizer.json; bos / eos from tokenizer_config.json), or "
                        "'bytes' for the UTF-8 bytes as ids (the engine's byte-level models)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="nanogpt: a folder for train.bin and val.bin; llmc: a prefix for PREFIX_train_000000.bin ... "
                        "and PREFIX_val_000000.bin; megatron: a prefix for PREFIX.bin/.idx and PREFIX_val.bin/.idx")
    p.add_argument("--format", choices=FORMATS, default="megatron",
                   help="nanogpt (ids, no header), llmc (256-int32 header, shards), megatron (.bin + .idx with the "
                        "document index)")
    p.add_argument("--text-key", default="text", help="the JSON field holding each line's text")
    p.add_argument("--split-documents", action="store_true",
                   help="a text file holds one document per block of lines between blank lines (default: the whole "
                        "file is one document)")
    p.add_argument("--eod-id", type=int, metavar="ID",
                   help="the id written after every document (default: the tokenizer's eos_token; none for bytes)")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="the share of documents held out for validation (every k-th document)")
    p.add_argument("--workers", type=int, help="encoding processes (default: every core this process may use)")
    p.add_argument("--shard-tokens", type=int, default=LLMC_SHARD_TOKENS, help="--format llmc: ids per shard")
    p.add_argument("--chat", action="store_true",
                   help="the inputs are JSON lines of conversations ({\"messages\": [...]} or {\"prompt\": ..., "
                        "\"completion\": ...}): rendered with the tokenizer folder's chat template, written with a "
                        "loss mask beside each token file (NAME.mask: the assistant tokens); nanogpt or megatron")
    p.add_argument("--parse-special", action="store_true",
                   help="match special tokens written in the text (e.g. '<|endoftext|>') as their ids; by default "
                        "such text is ordinary text, as nanoGPT and llm.c encode corpora")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check_numbers(args)
        files = expand_inputs(args.inputs, flag="tokenize")
        if args.chat:
            return _tokenize_chat(args, files)
        tokenizer = load(args.tokenizer) if args.tokenizer != BYTES else None
        vocab_size = tokenizer.vocab_size if tokenizer is not None else 256
        eod = args.eod_id if args.eod_id is not None else (
            special_ids(args.tokenizer, tokenizer).eos if tokenizer is not None else None)
        if eod is not None and not 0 <= eod < vocab_size:
            raise ConfigError(f"--eod-id {eod} is not a token id of this tokenizer (0 to {vocab_size - 1})")
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = token_dtype(args.format, vocab_size)
    train, val = _writers(args.format, Path(args.out), dtype, val=args.val_fraction > 0, shard_tokens=args.shard_tokens)
    workers = args.workers or _cores()
    print(f"tokenizing {len(files)} file(s) with {args.tokenizer} (vocabulary {vocab_size:,}, {dtype} ids, "
          f"{'eod ' + str(eod) if eod is not None else 'no end-of-document id'}) on {workers} worker(s)", flush=True)
    try:
        result = tokenize_files(files, EncodeSettings(args.tokenizer, dtype, eod, args.parse_special), train=train,
                                val=val, val_fraction=args.val_fraction, text_key=args.text_key,
                                split_documents=args.split_documents, workers=workers, tokenizer=tokenizer,
                                progress=Progress("tokenize", sum(f.stat().st_size for f in files)))
        if result.tokens == 0:
            raise DataError(f"the inputs hold no text ({len(files)} file(s))")
        if val is not None and result.val_tokens == 0:
            val.abort()
            val = None
            print(f"note: no document was held out for validation ({result.documents:,} documents x --val-fraction "
                  f"{args.val_fraction} < 1; --split-documents makes more of a text file)", file=sys.stderr)
        written = train.close() + (val.close() if val is not None else [])
    except (DataError, ValueError, OSError) as e:
        for writer in (train, val):
            if writer is not None:
                writer.abort()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        for writer in (train, val):
            if writer is not None:
                writer.abort()
        raise
    print(f"wrote {', '.join(map(str, written))}: {result.documents:,} documents, {result.tokens:,} tokens"
          + (f"; validation {result.val_documents:,} documents, {result.val_tokens:,} tokens" if val is not None else ""))
    print("train on it: " + _next_command(args.format, Path(args.out), dtype, val=val is not None and result.val_tokens > 0))
    print(json.dumps(_summary(args, result, written, dtype=dtype, vocab_size=vocab_size, eod=eod, workers=workers)))
    return 0


def _tokenize_chat(args: argparse.Namespace, files: list[Path]) -> int:
    """``--chat``: conversations -> token files and their loss masks (raises ConfigError / DataError on bad input)."""
    if args.format == "llmc":
        raise ConfigError("--chat writes --format nanogpt or megatron: llm.c's fixed-size shards would cut conversations")
    if args.eod_id is not None or args.tokenizer == BYTES:
        raise ConfigError("--chat: the chat template ends each turn itself; give a tokenizer folder with a chat "
                          "template and no --eod-id")
    encoder = ChatEncoder.from_folder(args.tokenizer)
    dtype = token_dtype(args.format, encoder.tokenizer.vocab_size)
    out = Path(args.out)
    paths = ([out / "train.bin", out / "val.bin"] if args.format == "nanogpt" else [Path(f"{out}.bin"), Path(f"{out}_val.bin")])
    writer = lambda path: ChatWriter(NanoGPTWriter(path, dtype) if args.format == "nanogpt"  # noqa: E731
                                     else MegatronWriter(path.with_suffix(""), dtype), MaskWriter(mask_path(path)))
    train, val = writer(paths[0]), writer(paths[1]) if args.val_fraction > 0 else None
    workers = args.workers or _cores()
    print(f"tokenizing the conversations of {len(files)} file(s) with {args.tokenizer}'s chat template (vocabulary "
          f"{encoder.tokenizer.vocab_size:,}, {dtype} ids, end of turn {' / '.join(encoder.end_markers)}) on "
          f"{workers} worker(s)", flush=True)
    try:
        read = encode_conversations(files, folder=args.tokenizer, encoder=encoder, train=train, val=val,
                                    val_fraction=args.val_fraction, workers=workers)
        if train.conversations == 0:
            named = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise DataError(f"{named}: no conversations in {'it' if len(files) == 1 else 'them'} (empty, or blank lines "
                            f"only); --chat reads one {{\"messages\": [...]}} object per line")
        if val is not None and val.conversations == 0:
            val.abort()
            val = None
        written = train.close() + (val.close() if val is not None else [])
    except BaseException:
        for w in (train, val):
            if w is not None:
                w.abort()
        raise
    split = {"train": train, **({"val": val} if val is not None else {})}
    print(f"wrote {', '.join(map(str, written))}: " + "; ".join(
        f"{name} {w.conversations:,} conversations, {w.tokens.tokens:,} tokens ({w.trained:,} trained)"
        for name, w in split.items()))
    print("train on it: " + _next_command(args.format, out, dtype, val=val is not None))
    print(json.dumps({"format": args.format, "files": [str(p) for p in written], "dtype": dtype, "input_bytes": read,
                      "workers": workers, **{f"{name}_{what}": value for name, w in split.items() for what, value in
                                             (("conversations", w.conversations), ("tokens", w.tokens.tokens),
                                              ("trained_tokens", w.trained))}}))
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _writers(fmt: str, out: Path, dtype: str, *, val: bool, shard_tokens: int):
    if fmt == "nanogpt":
        return NanoGPTWriter(out / "train.bin", dtype), NanoGPTWriter(out / "val.bin", dtype) if val else None
    if fmt == "llmc":
        make = lambda split: LlmcWriter(out, split, dtype, shard_tokens=shard_tokens)  # noqa: E731
        return make("train"), make("val") if val else None
    return MegatronWriter(out, dtype), MegatronWriter(Path(f"{out}_val"), dtype) if val else None


def _next_command(fmt: str, out: Path, dtype: str, *, val: bool) -> str:
    """The flags that make ``run.py`` read what was written (and validate on the held-out share)."""
    if fmt == "nanogpt":
        return f"--data {out}" + (f" --token-dtype {dtype}" if dtype != "uint16" else "")
    if fmt == "llmc":
        return f"--data '{out}_*.bin'"
    return f"--data {out}" + (f" --val-data {out}_val" if val else "")


def _summary(args, result: TokenizeResult, written: list[Path], *, dtype: str, vocab_size: int, eod: int | None,
             workers: int) -> dict:
    return {"format": args.format, "files": [str(p) for p in written], "documents": result.documents,
            "tokens": result.tokens, "val_documents": result.val_documents, "val_tokens": result.val_tokens,
            "dtype": dtype, "vocab_size": vocab_size, "eod_id": eod, "input_bytes": result.input_bytes,
            "seconds": round(result.seconds, 3), "mb_per_s": round(result.input_bytes / 1e6 / max(result.seconds, 1e-9), 3),
            "workers": workers}
