"""The SFT benchmark's pieces (runtime/lab/sft_benchmark.py): seeded conversations of mixed length, and per-second
conversation and trained tokens counted from the windows a run's steps read (padding excluded)."""

from __future__ import annotations

import argparse
import json

from runtime.lab.sft_benchmark import conversations, measured
from tests.chat_data import CHAT_TOKENIZERS


def test_conversations_are_seeded_and_of_mixed_length():
    first, again = conversations(200, longest=200), conversations(200, longest=200)
    assert first == again
    answers = [len(m["content"].split()) for r in first for m in r["messages"] if m["role"] == "assistant"]
    assert min(answers) == 1 and max(answers) > 100 and sorted(answers)[len(answers) // 2] < 30  # a long tail


def test_measured_counts_the_windows_tokens_per_second(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(60, longest=80)))
    args = argparse.Namespace(micro_batch_size=4, seq_len=128, steps=3, tokenizer=str(CHAT_TOKENIZERS / "qwen2-style"))
    summary = {"step_time_s": 3.0, "step_times": [9.0, 3.0, 2.0, 4.0]}  # the first step (tracing) is not counted
    packed, alone = (measured(summary, data=data, args=args, vocab=2051, packing=p) for p in (True, False))
    assert packed["windows_per_epoch"] < alone["windows_per_epoch"] and packed["fill"] > alone["fill"]
    for row in (packed, alone):  # padding excluded: at most the window tokens, at least the trained ones
        assert row["best_step_s"] == 2.0 and row["tokens_per_sec"] == 4 * 128 / 2.0
        assert row["trained_tokens_per_sec"] < row["conversation_tokens_per_sec"] <= 4 * 129 / 2.0
