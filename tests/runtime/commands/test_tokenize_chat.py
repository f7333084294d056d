"""``run.py tokenize --chat``: conversations -> token files and loss masks that ``--data`` trains on exactly as it
trains on the JSON lines themselves (the same bytes as the data cache's entry); a validation share; one-line
errors that name the file and line, and leave no file behind."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.commands import tokenize as tokenize_command
from runtime.engine.data import build_data, evaluation_corpus
from runtime.engine.data.chat_corpus import PackingOptions
from tests.chat_data import CHAT_TOKENIZERS, mixed_conversations, write_chat

TOKENIZER = CHAT_TOKENIZERS / "qwen2-style"
VOCAB = 2051


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _run(argv: list, capsys) -> tuple[int, str, str]:
    code = tokenize_command.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _windows(corpus) -> list[tuple[list[int], list[bool]]]:
    return [(corpus.window(g).tolist(), corpus.target_mask(g).tolist()) for g in range(corpus.windows)]


@pytest.mark.parametrize("workers", [1, 2])
def test_megatron_files_are_the_cache_entry_and_train_alike(tmp_path, capsys, workers):
    data = write_chat(tmp_path / "chat.jsonl", mixed_conversations(20))
    code, out, err = _run(["--chat", "--tokenizer", TOKENIZER, data, "--out", tmp_path / "out" / "chat",
                           "--workers", workers], capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["train_conversations"] == 20 and 0 < summary["train_trained_tokens"] < summary["train_tokens"]
    options = PackingOptions(256)
    from_jsonl, _, _ = evaluation_corpus(str(data), vocab_size=VOCAB, seq_len=256, cache_dir=tmp_path / "cache",
                                         tokenizer=str(TOKENIZER), packing=options)
    (entry,) = (tmp_path / "cache").glob("chat-*.bin")
    for suffix in (".bin", ".idx", ".mask"):  # the cache's entry, byte for byte
        assert (tmp_path / "out" / f"chat{suffix}").read_bytes() == entry.with_suffix(suffix).read_bytes()
    from_files, _, description = evaluation_corpus(str(tmp_path / "out" / "chat"), vocab_size=VOCAB, seq_len=256,
                                                   cache_dir=tmp_path / "cache", packing=options)
    assert "Megatron indexed dataset with loss masks" in description
    assert _windows(from_files) == _windows(from_jsonl)


def test_nanogpt_files_with_a_validation_share(tmp_path, capsys):
    records = mixed_conversations(20)
    data = write_chat(tmp_path / "chat.jsonl", records)
    code, out, err = _run(["--chat", "--tokenizer", TOKENIZER, data, "--out", tmp_path / "out", "--format", "nanogpt",
                           "--val-fraction", "0.25"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.bin", "train.mask", "val.bin", "val.mask"]
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["train_conversations"], summary["val_conversations"]) == (15, 5)
    assert "train on it: --data " in out
    sources = build_data(str(tmp_path / "out"), vocab_size=VOCAB, seq_len=256, global_batch_size=2, seed=0,
                         val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert sources.chat and "validation on its validation files" in sources.description
    val = sources.val.components[0].corpus
    assert val.conversations == 5
    # Conversation 3 (every fourth, from the second on: floor((i + 1) / 4) > floor(i / 4)) is validation's first.
    held = write_chat(tmp_path / "held.jsonl", [records[3]])
    alone, _, _ = evaluation_corpus(str(held), vocab_size=VOCAB, seq_len=256, cache_dir=tmp_path / "cache",
                                    tokenizer=str(TOKENIZER), packing=PackingOptions(256, packing=False))
    first = val.files[0].tokens[: alone.layout[0][0].length]
    assert torch.equal(first.long(), alone.window(0)[: alone.layout[0][0].length])


@pytest.mark.parametrize("extra, line, message", [
    ([], '{"messages": [{"role": "narrator", "content": "x"}]}', "chat.jsonl:2: message 0: unknown role 'narrator'"),
    (["--format", "llmc"], '{"prompt": "a", "completion": "b"}', "--chat writes --format nanogpt or megatron"),
    (["--eod-id", "5"], '{"prompt": "a", "completion": "b"}', "--chat: the chat template ends each turn itself"),
])
def test_bad_input_is_one_error_line_and_no_files(tmp_path, capsys, extra, line, message):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    code, _, err = _run(["--chat", "--tokenizer", TOKENIZER, data, "--out", tmp_path / "out" / "chat", *extra], capsys)
    assert code == 2
    (error,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert message in error
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_file_without_conversations_is_named(tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    code, _, err = _run(["--chat", "--tokenizer", TOKENIZER, data, "--out", tmp_path / "out" / "chat"], capsys)
    assert code == 2
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f'error: {data}: no conversations in it (empty, or blank lines only); --chat reads one {{"messages": [...]}} '
        f"object per line"]
