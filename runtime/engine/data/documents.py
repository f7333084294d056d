"""Documents from text corpora, streamed in bounded memory: what ``tokenize`` and ``--data corpus.txt
--tokenizer`` read.

    a text file      one document (or, with ``split_documents``, one per block of lines between blank lines,
                     without the line break that ends its last line)
    a JSON-lines file (.jsonl, .json, .ndjson)   one document per line: the string under ``text_key``
    a folder         every such file under it, sorted;  a glob: the files it matches, sorted

Files are read in 4 MiB blocks. A document longer than ``segment_chars`` is handed on in segments cut
where its ids cannot change (runtime/tokenizer/segments.py; never, if the tokenizer allows no cut), so a
1 GB single-document file never sits in memory whole. Empty documents are skipped (as Megatron-LM's
preprocess_data.py does). Bad input is a DataError naming the file and the byte offset or line.
"""

from __future__ import annotations

import codecs
import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from runtime.engine.data.corpus import DataError
from runtime.tokenizer.segments import segments

JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
BLOCK_BYTES = 1 << 22
_BLANK_LINES = re.compile(r"\r?\n(?:[ \t\r\f\v]*\n)+")


@dataclass(frozen=True)
class Segment:
    text: str
    continued: bool  # continues the previous segment's document
    ends_document: bool
    input_bytes: int  # bytes of input read for it (progress)


def expand_inputs(specs: list[str], *, flag: str) -> list[Path]:
    """Files, folders and globs -> the input files, in order (each folder's and glob's sorted)."""
    files: list[Path] = []
    for spec in specs:
        if any(c in spec for c in "*?["):
            matched = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matched:
                raise DataError(f"{flag} {spec}: the glob matches no files")
            files.extend(matched)
        elif Path(spec).is_dir():
            found = sorted(p for p in Path(spec).rglob("*") if p.is_file()
                           and p.suffix.lower() in TEXT_SUFFIXES + JSON_LINES_SUFFIXES)
            if not found:
                raise DataError(f"{flag} {spec}: the folder holds no text ({', '.join(TEXT_SUFFIXES)}) or JSON-lines "
                                f"({', '.join(JSON_LINES_SUFFIXES)}) files")
            files.extend(found)
        elif Path(spec).is_file():
            files.append(Path(spec))
        else:
            raise DataError(f"{flag} {spec}: no such file or folder")
    return files


def read_segments(files: list[Path], *, text_key: str = "text", split_documents: bool = False,
                  cut: re.Pattern | None = None, segment_chars: int = 1 << 20) -> Iterator[Segment]:
    for path in files:
        if path.suffix.lower() in JSON_LINES_SUFFIXES:
            yield from _json_lines(path, text_key=text_key, cut=cut, segment_chars=segment_chars)
        else:
            yield from _text_file(path, split_documents=split_documents, cut=cut, segment_chars=segment_chars)


def _document(text: str, *, cut: re.Pattern | None, segment_chars: int, input_bytes: int) -> Iterator[Segment]:
    parts = segments(text, cut, target_chars=segment_chars)
    for i, part in enumerate(parts):
        yield Segment(part, i > 0, i == len(parts) - 1, input_bytes if i == len(parts) - 1 else 0)


def _json_lines(path: Path, *, text_key: str, cut: re.Pattern | None, segment_chars: int) -> Iterator[Segment]:
    pending = 0  # bytes of skipped lines, counted with the next document (progress)
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            pending += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{path}:{number}: not a JSON object ({e})") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{number}: no string under --text-key {text_key!r} (it has: {keys})")
            if text:
                yield from _document(text, cut=cut, segment_chars=segment_chars, input_bytes=pending)
                pending = 0
    if pending:
        yield Segment("", False, False, pending)  # only progress


def _text_file(path: Path, *, split_documents: bool, cut: re.Pattern | None, segment_chars: int) -> Iterator[Segment]:
    """One document per file, or per blank-line block; long documents in segments as they are read."""
    document, carry, pending_bytes = _Cutter(cut, segment_chars), "", 0

    def emit(texts: list[str], *, ends: bool) -> Iterator[Segment]:
        nonlocal pending_bytes
        for i, text in enumerate(texts):
            last = ends and i == len(texts) - 1
            if text or not last or document.continued:
                yield Segment(text, document.continued, last, pending_bytes)
                pending_bytes = 0
            document.continued = not last

    for block, n_bytes in _decoded_blocks(path):
        pending_bytes += n_bytes
        if not split_documents:
            yield from emit(document.feed(block), ends=False)
            continue
        # A run of line breaks at the end may grow into a separator in the next block: keep it back.
        text = carry + block
        body = len(text.rstrip(" \t\r\f\v\n"))
        breaks = [i for i in (text.find("\r", body), text.find("\n", body)) if i >= 0]
        text, carry = (text[:min(breaks)], text[min(breaks):]) if breaks else (text, "")
        *complete, rest = _BLANK_LINES.split(text)
        for part in complete:
            yield from emit(document.feed(part) + [document.finish(strip_line_break=False)], ends=True)
        yield from emit(document.feed(rest), ends=False)
    *complete, rest = _BLANK_LINES.split(carry) if split_documents else [""]
    for part in complete:
        yield from emit(document.feed(part) + [document.finish(strip_line_break=False)], ends=True)
    yield from emit(document.feed(rest) + [document.finish(strip_line_break=split_documents)], ends=True)
    if pending_bytes:
        yield Segment("", False, False, pending_bytes)  # only progress: the file held no document


class _Cutter:
    """A document's text as it is read, handed back in segments cut at the first cut point past every
    ``segment_chars`` characters (linear: each new piece is searched once, with 3 characters of context for
    the cut pattern's look-behind)."""

    def __init__(self, cut: re.Pattern | None, segment_chars: int):
        self.cut, self.segment_chars = cut, segment_chars
        self.parts: list[str] = []
        self.length, self.tail, self.continued = 0, "", False

    def feed(self, text: str) -> list[str]:
        out: list[str] = []
        context, start = self.tail + text, len(self.tail)
        while self.cut is not None:
            at = max(start, start + self.segment_chars - self.length)
            m = self.cut.search(context, at) if at < len(context) else None
            if m is None or m.start() >= len(context):
                break
            out.append("".join([*self.parts, context[start: m.start()]]))
            self.parts, self.length, start = [], 0, m.start()
        if start < len(context):
            self.parts.append(context[start:])
            self.length += len(context) - start
        self.tail = context[-3:]
        return out

    def finish(self, *, strip_line_break: bool = True) -> str:
        """The rest of the document (without the line break ending its last line, for blank-line blocks)."""
        text = "".join(self.parts)
        self.parts, self.length, self.tail = [], 0, ""
        if strip_line_break:
            text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
        return text


def _decoded_blocks(path: Path) -> Iterator[tuple[str, int]]:
    decoder, done = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            try:
                yield decoder.decode(block), len(block)
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text (invalid byte at offset {done + e.start:,})") from None
            done += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text (it ends inside a character)") from None
