"""Chat data for the tests: conversations of mixed length (1 or 2 exchanges, answers of 1 to 12 words, some far
longer than a test window), seeded, written as the JSON lines ``--data`` reads."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

from tests.paths import FIXTURE_ROOT

CHAT_TOKENIZERS = FIXTURE_ROOT / "tokenizers" / "chat"  # llama3-style, qwen2-style, sentencepiece-style
WORDS = "the cat sat on a mat and then it ran far away from home to see the big blue sea".split()


def mixed_conversations(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` records: every fourth a prompt / completion pair, the others 1 or 2 user / assistant exchanges (one
    in seven with an answer of 60 words, longer than a 64-token window)."""
    rng = random.Random(seed)

    def text(most: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(1, most)))

    records = []
    for i in range(n):
        if i % 4 == 0:
            records.append({"prompt": text(6), "completion": text(10)})
            continue
        messages = [{"role": "system", "content": "Answer briefly."}] if i % 5 == 0 else []
        for _ in range(rng.randint(1, 2)):
            messages += [{"role": "user", "content": text(6)},
                         {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=60)) if i % 7 == 3 else text(12)}]
        records.append({"messages": messages})
    return records


def write_chat(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def shared_chat_file(n: int = 64, *, seed: int = 0) -> Path:
    """``mixed_conversations(n, seed)`` in a file named by its content under the system's temporary folder: the same
    path in every process of a test session (the ranks of a spawned job read it as ``--data``)."""
    text = "".join(json.dumps(r) + "\n" for r in mixed_conversations(n, seed=seed))
    path = Path(tempfile.gettempdir()) / "hybrid_engine_tests" / f"chat-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # whole or absent, whoever writes it first
    return path
