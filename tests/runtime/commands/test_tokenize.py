"""``run.py tokenize``: the files it writes are byte for byte the files tests/token_writers.py writes (from the
nanoGPT, llm.c and Megatron-LM specifications) for the same ids, and ``--data`` reads them back; documents
from text, blank-line blocks and JSON lines; long documents in exact segments; one worker or two; the
validation share; ``--data corpus.txt --tokenizer`` tokenized once into the cache; one-line errors."""

from __future__ import annotations

import json
import math
import random
import re
from array import array
from pathlib import Path

import pytest

from runtime.commands import tokenize as tokenize_command
from runtime.engine.data import DataError, build_data, documents
from runtime.engine.data import tokenize as tokenize_module
from runtime.engine.data import tokenized_text as tokenized_text_module
from runtime.engine.data.writers import LlmcWriter, token_dtype
from runtime.tokenizer import load_tokenizer
from tests.paths import FIXTURE_ROOT
from tests.token_writers import pack, write_llmc, write_megatron, write_nanogpt

FIXTURES = FIXTURE_ROOT / "tokenizers"
LLAMA3 = FIXTURES / "llama3-style"
EOS = 2033  # <|end_of_text|>


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def llama3():
    return load_tokenizer(LLAMA3)


def _corpus(root: Path) -> tuple[list[Path], list[str]]:
    """Three text files and a JSON-lines file: 6 documents, with CRLF, specials as text, an empty line."""
    root.mkdir(parents=True, exist_ok=True)
    texts = ["The quick brown fox.\nIt's 2024!\n", "Zweite Datei: über 3,5 km.\r\n<|end_of_text|> stays text.\n",
             "中文，全角！\n\n\tindented\n" * 3]
    files = []
    for i, text in enumerate(texts):
        files.append(root / f"{i}.txt")
        files[-1].write_bytes(text.encode())
    lines = [{"text": "first json doc 🙂", "id": 1}, {"text": ""}, {"text": "last one\nwith two lines", "x": 2}]
    (root / "3.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    files.append(root / "3.jsonl")
    return files, [*texts, lines[0]["text"], lines[2]["text"]]  # the empty JSON document is skipped


def _tokens(data) -> list[int]:
    """Every token of the training and validation spans, in order."""
    spans = [*data.train.components[0].corpus.spans, *data.val.components[0].corpus.spans]
    return [t for span in spans for t in span.tokens[span.begin: span.end].tolist()]


def _split(docs: list[list[int]], fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """Document i is held out when floor((i + 1) f) > floor(i f)."""
    val = [math.floor((i + 1) * fraction) > math.floor(i * fraction) for i in range(len(docs))]
    return [d for d, v in zip(docs, val) if not v], [d for d, v in zip(docs, val) if v]


@pytest.mark.parametrize("workers", [1, 2])
def test_each_format_is_byte_for_byte_the_reference_writers(tmp_path, run_main, llama3, workers):
    files, texts = _corpus(tmp_path / "in")
    docs = [llama3.encode(t, split_special_tokens=True) + [EOS] for t in texts]
    train, val = _split(docs, 0.4)
    assert len(train) == 3 and len(val) == 2
    flat = lambda ds: [t for d in ds for t in d]  # noqa: E731
    common = ["--tokenizer", LLAMA3, *files, "--val-fraction", "0.4", "--workers", workers]

    code, out, err = run_main(tokenize_command.main, [*common, "--out", tmp_path / "nano", "--format", "nanogpt"])
    assert code == 0, err
    assert (tmp_path / "nano" / "train.bin").read_bytes() == write_nanogpt(tmp_path / "ref.bin", flat(train)).read_bytes()
    assert (tmp_path / "nano" / "val.bin").read_bytes() == write_nanogpt(tmp_path / "ref.bin", flat(val)).read_bytes()
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["documents"], summary["val_documents"], summary["tokens"]) == (3, 2, len(flat(train)))
    assert "MB/s" in err and "train on it: --data" in out

    code, out, err = run_main(tokenize_command.main, [*common, "--out", tmp_path / "shards" / "web", "--format", "llmc",
                                                      "--shard-tokens", 40])
    assert code == 0, err
    tokens = flat(train)
    for i in range(math.ceil(len(tokens) / 40)):
        ref = write_llmc(tmp_path / "ref.bin", tokens[i * 40: (i + 1) * 40]).read_bytes()
        assert (tmp_path / "shards" / f"web_train_{i:06d}.bin").read_bytes() == ref
    assert (tmp_path / "shards" / "web_val_000000.bin").read_bytes() == write_llmc(tmp_path / "ref.bin",
                                                                                   flat(val)[:40]).read_bytes()

    code, out, err = run_main(tokenize_command.main, [*common, "--out", tmp_path / "mega", "--format", "megatron"])
    assert code == 0, err
    for name, part in (("mega", train), ("mega_val", val)):
        ref = write_megatron(tmp_path / "ref", part, "uint16")
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"{name}{suffix}").read_bytes() == Path(f"{ref}{suffix}").read_bytes()
    assert f"--val-data {tmp_path / 'mega'}_val" in out


def test_data_reads_what_tokenize_wrote(tmp_path, run_main, llama3):
    files, texts = _corpus(tmp_path / "in")
    want = [t for text in texts for t in llama3.encode(text, split_special_tokens=True) + [EOS]]
    for fmt, out, spec in (("nanogpt", tmp_path / "n", tmp_path / "n"), ("llmc", tmp_path / "l" / "c", f"{tmp_path}/l/c_*.bin"),
                           ("megatron", tmp_path / "m", tmp_path / "m")):
        argv = ["--tokenizer", LLAMA3, *files, "--out", out, "--format", fmt, "--workers", 1]
        assert run_main(tokenize_command.main, argv).code == 0
        data = build_data(str(spec), vocab_size=2048, seq_len=8, global_batch_size=2, seed=1, val_fraction=0.1)
        assert _tokens(data) == want, fmt


def test_long_documents_in_segments_and_small_blocks_give_the_whole_documents_ids(tmp_path, run_main, llama3, monkeypatch):
    monkeypatch.setattr(tokenize_module, "SEGMENT_CHARS", 50)
    monkeypatch.setattr(tokenize_module, "BATCH_CHARS", 200)
    monkeypatch.setattr(documents, "BLOCK_BYTES", 37)
    text = "".join(f"Line {i}: some words, über café.\r\n" if i % 3 else f"  indented {i}\n\n\n" if i % 2 else
                   f"CRLF block {i}\r\n \r\n\r\n" for i in range(200))
    (tmp_path / "big.txt").write_text(text)
    blocks = [b.removesuffix("\r\n").removesuffix("\n") for b in re.split(r"\r?\n(?:[ \t\r\f\v]*\n)+", text)]
    sentencepiece = FIXTURES / "sentencepiece-style"  # its legacy "▁" goes in front of a document, not a segment
    for folder, split, workers in ((LLAMA3, False, 1), (LLAMA3, False, 2), (LLAMA3, True, 1), (LLAMA3, True, 2),
                                   (sentencepiece, False, 1), (sentencepiece, True, 2)):
        tokenizer, eos = (llama3, EOS) if folder == LLAMA3 else (load_tokenizer(folder), 2)
        docs = [b for b in blocks if b] if split else [text]
        out = tmp_path / f"o{folder.name}{split}{workers}"
        assert run_main(tokenize_command.main, ["--tokenizer", folder, tmp_path / "big.txt", "--out", out, "--format",
                                                "megatron", "--workers", workers,
                                                *(["--split-documents"] if split else [])]).code == 0
        ids = array("H", Path(f"{out}.bin").read_bytes()).tolist()
        assert ids == [t for d in docs for t in tokenizer.encode(d, split_special_tokens=True) + [eos]], (folder, split)


def test_a_document_read_piece_by_piece_is_cut_where_the_whole_text_would_be(llama3):
    from runtime.tokenizer.segments import cut_pattern, segments

    cut = cut_pattern(llama3)
    text = "".join(f"word{i} x.\n" if i % 4 else f"{i}\r\n" for i in range(3000))
    rng = random.Random(0)
    cutter, pieces, at = documents._Cutter(cut, 100), [], 0
    while at < len(text):
        step = rng.randrange(1, 40)
        pieces += cutter.feed(text[at: at + step])
        at += step
    pieces.append(cutter.finish(strip_line_break=False))
    assert pieces == segments(text, cut, target_chars=100) and len(pieces) > 100


def test_bytes_and_json_lines_with_a_text_key(tmp_path, run_main):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "héllo"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    code, out, err = run_main(tokenize_command.main, ["--tokenizer", "bytes", tmp_path / "a.jsonl", "--text-key", "body",
                                                      "--out", tmp_path / "o", "--format", "nanogpt", "--eod-id", 0])
    assert code == 0, err
    assert (tmp_path / "o" / "train.bin").read_bytes() == pack([*"héllo".encode(), 0, *b"x", 0], "uint16")


def test_dtypes_follow_each_formats_tools():
    assert [token_dtype("nanogpt", v) for v in (2048, 65536, 65537, 128256)] == ["uint16", "uint16", "uint32", "uint32"]
    assert [token_dtype("megatron", v) for v in (65499, 65500, 128256)] == ["uint16", "int32", "int32"]


def test_llmc_uint32_shards_are_the_reference_writers(tmp_path):
    ids = [0, 70000, 128255, 5, 99999]
    writer = LlmcWriter(tmp_path / "big", "train", "uint32", shard_tokens=3)
    writer.add(array("I", ids).tobytes(), ends_document=True)
    assert writer.close() == [tmp_path / "big_train_000000.bin", tmp_path / "big_train_000001.bin"]
    assert (tmp_path / "big_train_000000.bin").read_bytes() == write_llmc(tmp_path / "r", ids[:3], version=7).read_bytes()
    assert (tmp_path / "big_train_000001.bin").read_bytes() == write_llmc(tmp_path / "r", ids[3:], version=7).read_bytes()


@pytest.mark.parametrize("setup, argv, words", [
    (lambda p: p.write_text('{"text": "a"}\n{"txt": "b"}\n'), ["{f}", "--format", "nanogpt"], ["c.jsonl:2", "--text-key 'text'"]),
    (lambda p: p.write_text("not json\n"), ["{f}"], ["c.jsonl:1", "not a JSON object"]),
    (lambda p: p.with_suffix(".txt").write_bytes(b"ok \xff"), ["{txt}"], ["c.txt is not UTF-8", "offset 3"]),
    (None, ["{f}", "--val-fraction", "1.5"], ["--val-fraction must be in [0, 1)"]),
    (None, ["{f}", "--eod-id", "5000"], ["--eod-id 5000", "0 to 2047"]),
    (None, ["missing.txt"], ["missing.txt: no such file"]),
    (None, ["{f}", "--format", "hdf5"], ["--format", "invalid choice"]),
])
def test_bad_input_is_one_error_line(tmp_path, run_main, setup, argv, words):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n')
    if setup:
        setup(path)
    argv = [a.format(f=path, txt=path.with_suffix(".txt")) for a in argv]
    code, out, err = run_main(tokenize_command.main, ["--tokenizer", LLAMA3, *argv, "--out", tmp_path / "o", "--workers", "1"])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    assert all(w in errors[0] for w in words), err
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".*tmp"))  # nothing half-written is left


def test_an_unsupported_tokenizer_is_one_error_line(tmp_path, run_main):
    spec = json.loads((LLAMA3 / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "a.txt").write_text("a")
    code, _, err = run_main(tokenize_command.main, ["--tokenizer", tmp_path / "tok", tmp_path / "a.txt", "--out", tmp_path / "o",
                                                    "--workers", 1])
    assert code == 2 and err == (f'error: {tmp_path / "tok" / "tokenizer.json"}: pre_tokenizer type "Whitespace" is not '
                                 f"supported (supported: ByteLevel, Split, Sequence, Metaspace, Digits)\n")


def test_text_data_with_a_tokenizer_is_tokenized_once_into_the_cache(tmp_path, llama3, monkeypatch):
    files, texts = _corpus(tmp_path / "in")
    folder = tmp_path / "in"
    for f in files[3:]:
        f.unlink()  # --data reads .txt files
    want = [t for text in texts[:3] for t in llama3.encode(text, split_special_tokens=True) + [EOS]]
    kw = dict(vocab_size=2048, seq_len=8, global_batch_size=2, seed=1, val_fraction=0.2, tokenizer=str(LLAMA3))
    data = build_data(str(folder), **kw)
    assert "tokenized text" in data.description and not data.byte_level
    assert _tokens(data) == want
    span = data.train.components[0].corpus.spans[0]
    lengths = [len(llama3.encode(t, split_special_tokens=True)) + 1 for t in texts[:3]]
    assert span.documents.starts_around(0, len(want)) == [0, lengths[0], lengths[0] + lengths[1]]  # one per file

    def no_second_time(*a, **k):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(tokenized_text_module, "_tokenize", no_second_time)
    build_data(str(folder), **kw)  # a cache hit
    files[0].write_text("changed text")
    with pytest.raises(AssertionError, match="tokenized again"):
        build_data(str(folder), **kw)  # the contents are in the key
    monkeypatch.undo()
    with pytest.raises(DataError, match="has 2,048 tokens, more than the model's vocabulary"):
        build_data(str(folder), **{**kw, "vocab_size": 1000})
    builtin = build_data("builtin", **kw)
    assert "tokenized text" in builtin.description


def test_train_takes_the_tokenizer_from_its_flag_or_the_init_from_folder(tmp_path):
    from runtime.commands.flags import parse_train_config
    from runtime.config import ConfigError
    from tests.hf_folders import llama_config, write_folder

    cfg = parse_train_config(["--model", "tiny", "--vocab-size", "2048", "--tokenizer", str(LLAMA3)], world_size=1)
    assert cfg.data.tokenizer == str(LLAMA3)
    folder = write_folder(tmp_path / "m", llama_config(generation=5, layers=2, hidden=32, inner=64, vocab_size=2048)).path
    assert parse_train_config(["--init-from", str(folder)], world_size=1).data.tokenizer is None
    (folder / "tokenizer.json").write_bytes((LLAMA3 / "tokenizer.json").read_bytes())
    assert parse_train_config(["--init-from", str(folder)], world_size=1).data.tokenizer == str(folder)
    with pytest.raises(ConfigError, match="--tokenizer nowhere: no tokenizer.json there"):
        parse_train_config(["--tokenizer", "nowhere"], world_size=1)
