"""char_spans_to_token_spans against Hugging Face's offsets: the chat fixtures' assistant_token_spans (made from
transformers' offset_mapping), and, for edges that fall inside tokens, against the tokens overlapping the span
found by brute force from offsets worked out independently: byte-level tokens of ASCII text cover their own
decoded text; SentencePiece tokens cover their piece of "▁" + text with spaces as "▁", less the prepended "▁"."""

from __future__ import annotations

import json
import random

import pytest

from runtime.tokenizer import TokenizerError, char_spans_to_token_spans, load_tokenizer
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "tokenizers" / "chat"


@pytest.mark.parametrize("style", ["llama3-style", "qwen2-style", "sentencepiece-style"])
def test_the_chat_fixtures_token_spans(style):
    tokenizer = load_tokenizer(FIXTURES / style)
    for case in json.loads((FIXTURES / style / "expected.json").read_text(encoding="utf-8"))["cases"]:
        spans = [tuple(span) for span in case["assistant_spans"]]
        assert [list(s) for s in char_spans_to_token_spans(tokenizer, case["text"], spans)] == \
            case["assistant_token_spans"], case["name"]


def _overlapping(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens whose [a, b) overlaps [start, end) (transformers' assistant mask rule)."""
    inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return inside[0], inside[-1] + 1


def _random_spans(length: int, count: int = 200) -> list[tuple[int, int]]:
    rng = random.Random(0)
    spans = [tuple(sorted(rng.sample(range(length + 1), 2))) for _ in range(count)]
    return [(a, b) for a, b in spans if a < b]


def test_edges_inside_byte_level_tokens_take_the_whole_token():
    tokenizer = load_tokenizer(FIXTURES / "llama3-style")
    text = ("<|start_header_id|>assistant<|end_header_id|>\n\nThe answer, 12345 apples (roughly), "
            "is written   here\twith spaces; nevertheless it's done.<|eot_id|> tail")
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    ends = [sum(map(len, pieces[: i + 1])) for i in range(len(pieces))]
    offsets = list(zip([0, *ends[:-1]], ends))
    assert any(b - a > 3 for a, b in offsets)  # some tokens are long enough to hold an edge inside
    spans = _random_spans(len(text))
    assert char_spans_to_token_spans(tokenizer, text, spans, ids=ids) == [_overlapping(offsets, a, b) for a, b in spans]


def test_edges_inside_sentencepiece_tokens_take_the_whole_token():
    tokenizer = load_tokenizer(FIXTURES / "sentencepiece-style")
    text = "The answer is written here, with spaces; nevertheless it is done and the function returns."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.model.id_to_token[i] for i in ids]
    assert "".join(pieces) == "\u2581" + text.replace(" ", "\u2581")  # no byte-fallback tokens in this text
    assert "".join(tokenizer.decode([i]) for i in ids) != text  # so the offsets come from prefix encodings
    ends = [sum(map(len, pieces[: i + 1])) - 1 for i in range(len(pieces))]  # - 1: the prepended "▁"
    offsets = list(zip([0, *ends[:-1]], ends))
    spans = _random_spans(len(text))
    assert char_spans_to_token_spans(tokenizer, text, spans) == [_overlapping(offsets, a, b) for a, b in spans]


def test_a_span_outside_the_text_is_an_error():
    tokenizer = load_tokenizer(FIXTURES / "llama3-style")
    with pytest.raises(TokenizerError, match=r"character span \[2, 9\) is not inside the text \(length 5\)"):
        char_spans_to_token_spans(tokenizer, "hello", [(2, 9)])
