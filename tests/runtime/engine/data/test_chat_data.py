"""Chat data through the data pipeline: every fixture conversation of the three styles (transformers' renders in
tests/fixtures/tokenizers/chat) becomes exactly transformers' ids, and the loss mask the engine trains with marks
exactly the fixture's assistant token spans; packing keeps conversations whole and apart; long conversations are
cut or left out with a count; bad lines are one error naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.engine.data import DataError, build_data, evaluation_corpus
from runtime.engine.data.chat_corpus import PackingOptions
from runtime.engine.data.inputs import document_ids
from runtime.tokenizer import load_tokenizer
from tests.paths import FIXTURE_ROOT

CHAT = FIXTURE_ROOT / "tokenizers" / "chat"
STYLES = ("llama3-style", "qwen2-style", "sentencepiece-style")
VOCAB = 2051  # the largest of the three tokenizers'


def _cases(style: str) -> list[tuple[dict, dict]]:
    cases = json.loads((CHAT / style / "cases.json").read_text())["cases"]
    expected = json.loads((CHAT / style / "expected.json").read_text())["cases"]
    return list(zip(cases, expected))


def _write_chat(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _record(case: dict) -> dict:
    return {"messages": case["messages"], **({"tools": case["tools"]} if "tools" in case else {})}


@pytest.mark.parametrize("style", STYLES)
def test_fixture_conversations_become_transformers_ids_and_assistant_masks(tmp_path, style):
    cases = _cases(style)
    data = _write_chat(tmp_path / "chat.jsonl", [_record(case) for case, _ in cases])
    corpus, _, description = evaluation_corpus(str(data), vocab_size=VOCAB, seq_len=1024, cache_dir=tmp_path / "cache",
                                               tokenizer=str(CHAT / style), packing=PackingOptions(1024, packing=False))
    assert corpus.windows == len(cases) and "6 conversations" in description
    for g, (case, expected) in enumerate(cases):  # without packing, window g is conversation g alone
        window, trained = corpus.window(g), corpus.target_mask(g)
        ids, n = expected["ids"], corpus.layout[g][0].length
        # Training renders no generation prompt: where the fixture has one, the conversation is its ids before it
        # (Mixtral's template writes none either way).
        assert n == len(ids) or case["add_generation_prompt"], case["name"]
        assert window[:n].tolist() == ids[:n], case["name"]
        assert set(window[n:].tolist()) <= {0}, case["name"]  # padding after it
        # Target t predicts token t + 1: the trained targets are the assistant tokens' predictions.
        want = torch.zeros(1024, dtype=torch.bool)
        for first, stop in expected["assistant_token_spans"]:
            want[first - 1: stop - 1] = True
        assert torch.equal(trained, want), case["name"]
        assert corpus.trained_targets(g) == sum(stop - first for first, stop in expected["assistant_token_spans"])


def test_a_generation_prompt_case_differs_from_training_only_by_the_prompt(tmp_path):
    """The llama3 generation-prompt fixture ends with the empty assistant header training does not render."""
    (case, expected), = [(c, e) for c, e in _cases("llama3-style") if c["name"] == "generation_prompt"]
    data = _write_chat(tmp_path / "chat.jsonl", [_record(case)])
    corpus, _, _ = evaluation_corpus(str(data), vocab_size=VOCAB, seq_len=256, cache_dir=tmp_path / "cache",
                                     tokenizer=str(CHAT / "llama3-style"), packing=PackingOptions(256, packing=False))
    header = load_tokenizer(CHAT / "llama3-style").encode("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert corpus.window(0)[: corpus.layout[0][0].length].tolist() + header == expected["ids"]


def _conversations(n: int, *, seed: int = 0) -> list[dict]:
    """Conversations of mixed length: 1 to 3 exchanges of 1 to 12 words."""
    rng = torch.Generator().manual_seed(seed)
    words = "the cat sat on a mat and then it ran far away to see the big blue sea".split()

    def text(most: int) -> str:
        k = int(torch.randint(1, most + 1, (1,), generator=rng))
        return " ".join(words[int(i)] for i in torch.randint(len(words), (k,), generator=rng))

    records = []
    for i in range(n):
        messages = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=rng))):
            messages += [{"role": "user", "content": text(8)}, {"role": "assistant", "content": text(12)}]
        records.append({"messages": messages} if i % 4 else {"prompt": text(5), "completion": text(6)})
    return records


def test_packed_windows_hold_whole_conversations_apart(tmp_path):
    data = _write_chat(tmp_path / "chat.jsonl", _conversations(30))
    options = PackingOptions(256)
    packed, _, _ = evaluation_corpus(str(data), vocab_size=VOCAB, seq_len=256, cache_dir=tmp_path / "cache",
                                     tokenizer=str(CHAT / "qwen2-style"), packing=options)
    alone, _, _ = evaluation_corpus(str(data), vocab_size=VOCAB, seq_len=256, cache_dir=tmp_path / "cache",
                                    tokenizer=str(CHAT / "qwen2-style"), packing=PackingOptions(256, packing=False))
    assert packed.conversations == alone.conversations == 30 and packed.windows < alone.windows
    assert packed.trained_total == alone.trained_total  # the same assistant tokens, packed or not
    assert packed.fill > 0.8
    for g in range(packed.windows):
        positions = packed.positions(g)
        ids = document_ids(positions[None])[0]
        at = 0
        for k, piece in enumerate(packed.layout[g]):
            span = slice(at, min(at + piece.length, 256))
            # each conversation restarts positions and is a document of its own: no attention across conversations
            assert positions[span].tolist() == list(range(span.stop - span.start))
            assert set(ids[span].tolist()) == {k + 1}
            assert packed.window(g)[at: at + piece.length].tolist() == packed.files[0].tokens[
                piece.start: piece.start + piece.length].tolist()
            at += piece.length
        if at < 256:  # the padding is a document of its own, never trained
            assert int(ids[at]) == len(packed.layout[g]) + 1 and not packed.target_mask(g)[at - 1:].any()


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_long_conversations_are_cut_or_dropped_and_counted(tmp_path, policy):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat sat " * 40}]}
    short = {"prompt": "the cat", "completion": "sat on a mat"}
    data = _write_chat(tmp_path / "chat.jsonl", [long, short, long, *[short] * 5])  # the last one is held out
    sources = build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                         cache_dir=tmp_path / "cache", tokenizer=str(CHAT / "llama3-style"),
                         packing=PackingOptions(64, long_conversations=policy))
    assert sources.chat
    corpus = sources.train.components[0].corpus
    assert sources.val.components[0].corpus.conversations == 1
    if policy == "truncate":
        assert "7 conversations packed" in sources.description
        assert "2 truncated to 65 tokens (--long-conversations truncate)" in sources.description
        assert sorted(p.length for window in corpus.layout for p in window)[-2:] == [65, 65]
    else:
        assert "5 conversations packed" in sources.description
        assert "2 longer than 65 tokens dropped (--long-conversations drop)" in sources.description
    assert sources.train.trained_targets(0) == sum(
        corpus.trained_targets(g) for g in [w for _, w in sources.train._windows(0, 0, 2)])


@pytest.mark.parametrize("line, message", [
    ('{"text": "no conversation"}', "chat.jsonl:2: a line without messages"),
    ('{"messages": [{"role": "robot", "content": "beep"}]}', "chat.jsonl:2: message 0: unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "chat.jsonl:2: message 0: \"content\" must be text"),
    ('{"messages": [{"role": "user"', "chat.jsonl:2: not valid JSON"),
    # Mixtral's template raises on roles that do not alternate: the template's message, with the line.
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
     "chat.jsonl:2: chat template line"),
])
def test_bad_lines_are_one_error_naming_the_file_and_line(tmp_path, line, message):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as error:
        build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                   cache_dir=tmp_path / "cache", tokenizer=str(CHAT / "sentencepiece-style"))
    assert message in str(error.value) and str(data) in str(error.value) and "\n" not in str(error.value)


def test_chat_data_needs_a_tokenizer_with_a_template(tmp_path):
    data = _write_chat(tmp_path / "chat.jsonl", _conversations(4))
    with pytest.raises(DataError, match="chat data is rendered with a chat template: give --tokenizer FOLDER"):
        build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                   cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="no chat template"):
        build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                   cache_dir=tmp_path / "cache", tokenizer=str(FIXTURE_ROOT / "tokenizers" / "llama3-style"))


@pytest.mark.parametrize("text, message", [
    ("", "--data {}: no conversations in it (empty, or blank lines only)"),
    ("\n  \n", "--data {}: no conversations in it (empty, or blank lines only)"),
    ('{"text": "no conversation"}\n', "{}:1: a line without messages"),
    ('{"messages": [\n', "{}:1: not valid JSON"),
])
def test_a_json_lines_file_whose_first_line_is_no_conversation_says_why(tmp_path, text, message):
    """Its name says chat data: the first line's problem, not a guess at the format by the name."""
    data = tmp_path / "chat.jsonl"
    data.write_text(text)
    with pytest.raises(DataError) as error:
        build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                   cache_dir=tmp_path / "cache", tokenizer=str(CHAT / "llama3-style"))
    assert str(error.value).startswith(message.format(data)) and "\n" not in str(error.value), str(error.value)


def test_conversations_all_dropped_as_too_long_name_the_file_given_and_the_way_out(tmp_path):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat sat " * 40}]}
    data = _write_chat(tmp_path / "chat.jsonl", [long] * 4)
    with pytest.raises(DataError) as error:
        build_data(str(data), vocab_size=VOCAB, seq_len=64, global_batch_size=2, seed=0, val_fraction=0.1,
                   cache_dir=tmp_path / "cache", tokenizer=str(CHAT / "llama3-style"),
                   packing=PackingOptions(64, long_conversations="drop"))
    assert str(error.value) == (f"--data {data}: no conversation has an assistant token to train on within --seq-len 64 "
                                f"+ 1 tokens (3 conversations, 3 dropped as too long); use --long-conversations truncate "
                                f"or a longer --seq-len")
