"""Chat data's flags: ``--data chat.jsonl`` (or token files with masks) is chat data, packed under the document mask
unless ``--no-packing``; the chat flags refuse plain data, chat and plain data do not mix, and a bad line of chat
data is one ``error:`` line from the training command naming the file and the line, before any process group."""

from __future__ import annotations

import pytest

from runtime.commands import train as train_command
from runtime.commands.flags import parse_train_config
from runtime.config import ConfigError
from tests.chat_data import CHAT_TOKENIZERS, mixed_conversations, write_chat

TOKENIZER = str(CHAT_TOKENIZERS / "llama3-style")


@pytest.fixture
def chat(tmp_path) -> str:
    return str(write_chat(tmp_path / "chat.jsonl", mixed_conversations(8)))


def _config(argv: list[str]):
    return parse_train_config(["--vocab-size", "2048", *argv], world_size=1)


def test_chat_data_is_packed_under_the_document_mask(chat, tmp_path):
    cfg = _config(["--data", chat, "--tokenizer", TOKENIZER])
    assert cfg.data.chat and cfg.data.packing and cfg.data.document_mask
    assert cfg.data.long_conversations == "truncate"
    cfg = _config(["--data", chat, "--tokenizer", TOKENIZER, "--no-packing", "--long-conversations", "drop"])
    assert cfg.data.chat and not cfg.data.packing and not cfg.data.document_mask
    assert cfg.data.long_conversations == "drop"
    (tmp_path / "c.bin").write_bytes(bytes(4))
    (tmp_path / "c.mask").write_bytes(bytes([2, 1, 2, 1]))  # a nanoGPT file with a mask beside it
    assert _config(["--data", str(tmp_path / "c.bin")]).data.chat
    assert not _config(["--data", "builtin"]).data.chat


@pytest.mark.parametrize("argv, message", [
    (["--no-packing"], "--no-packing applies to chat data"),
    (["--long-conversations", "drop"], "--long-conversations applies to chat data"),
])
def test_chat_flags_refuse_plain_data(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(["--data", "builtin", *argv])


def test_chat_data_does_not_mix_with_plain_tokens(chat, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("plain text")
    with pytest.raises(ConfigError, match=r"mix chat data \(.*chat.jsonl: loss on assistant tokens\) with plain tokens"):
        _config(["--data", f"0.5:{chat},0.5:{text}", "--tokenizer", TOKENIZER])
    with pytest.raises(ConfigError, match="mix chat data"):
        _config(["--data", chat, "--val-data", str(text), "--tokenizer", TOKENIZER])
    with pytest.raises(ConfigError, match="already trains only on assistant tokens"):
        _config(["--data", chat, "--tokenizer", TOKENIZER, "--no-loss-across-documents", "--eod-token", "1"])


def test_a_bad_line_is_one_error_line_naming_the_file_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    records = mixed_conversations(4)
    records[2] = {"messages": [{"role": "moderator", "content": "x"}]}
    data = write_chat(tmp_path / "chat.jsonl", records)
    code = train_command.main(["--data", str(data), "--tokenizer", TOKENIZER, "--vocab-size", "2048"])
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {data}:3: message 0: unknown role 'moderator' (valid: system, user, assistant, tool)"]


def test_a_validation_file_of_no_kind_yet_is_not_called_a_mix(chat, tmp_path, monkeypatch, capsys):
    """An empty --val-data .jsonl is neither chat nor plain data: the line names what is wrong with it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    empty = tmp_path / "val.jsonl"
    empty.write_text("")
    assert _config(["--data", chat, "--val-data", str(empty), "--tokenizer", TOKENIZER]).data.chat
    code = train_command.main(["--data", chat, "--val-data", str(empty), "--tokenizer", TOKENIZER, "--vocab-size", "2048"])
    assert code == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [
        f"error: --val-data {empty}: no conversations in it (empty, or blank lines only); chat data is one "
        '{"messages": [...]} object per line']
