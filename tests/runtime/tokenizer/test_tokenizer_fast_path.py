"""The tokenizer's fast path (runtime/tokenizer/tokenizer.py: one ``findall`` per piece, then the chunk cache of
segments.py) against the exact split of pre_tokenizers.py, for gpt-oss's o200k structure (Split ``Removed`` with
invert): the reference cases and texts written for its rules give the same words and ids either way; the fast path
is taken only for the behaviors whose matches are the words, and never where Python's ``re`` and Oniguruma iterate
empty matches differently."""

from __future__ import annotations

import copy
import json
import random

import pytest

from runtime.tokenizer import load_tokenizer
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.pre_tokenizers import BEHAVIORS, START
from runtime.tokenizer.segments import cut_pattern, segments
from runtime.tokenizer.tokenizer import Tokenizer
from tests.paths import FIXTURE_ROOT

FOLDER = FIXTURE_ROOT / "tokenizers" / "o200k-style"
WRITTEN = [
    "CamelCaseWord parseHTTPResponse iPhone XMLHttpRequest ÉCOLE E\u0301COLE ǅemal",
    "don't DON'T I'LL we'Re they've She'd I'm it'sy 's 'S x'ſ ''ll",
    "1234567 3.14159 ٣٤٥٦ Ⅻ½ 2024-01-01 +1(555)0100",
    "line one\r\nline two\r\n\r\n  indented\r\n\ttab\r\n",
    "path/to/file.txt:\n/usr/bin/env http://x.org// end.//\n\n...\r\n/next ?!/\r\n",
    "mixed 中文 Ελληνικά Русский العربية हिन्दी 🙂👩\u200d💻🇫🇷 <|endoftext|> <|call|> x",
    "    \n\n   a  b   ", "", " ", "\u2028\x85\xa0x\u3000y",
]


@pytest.fixture(scope="module")
def o200k() -> Tokenizer:
    return load_tokenizer(FOLDER)


def _slow(tokenizer: Tokenizer) -> Tokenizer:
    slow = copy.copy(tokenizer)
    slow._fast_regex, slow.chunk_cache = None, None
    return slow


def _texts() -> list[str]:
    cases = json.loads((FOLDER / "expected.json").read_text())["cases"]
    rng = random.Random(11)
    pieces = [w for text in WRITTEN for w in text.split(" ")] + [" ", "  ", "\n", "\r\n", "/", "'", "'S"]
    random_texts = ["".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30))) for _ in range(300)]
    return [(FOLDER / c["file"]).read_bytes().decode("utf-8") for c in cases] + WRITTEN + random_texts


def test_o200k_takes_the_fast_path_and_it_changes_no_ids(o200k):
    assert o200k._fast_regex is not None and o200k.chunk_cache is not None
    slow = _slow(o200k)
    for text in _texts():
        assert o200k.words(text, START) == slow.pre_tokenizer.words(text, START), repr(text)
        for split_special in (False, True):
            assert o200k.encode(text, split_special_tokens=split_special) == slow.encode(
                text, split_special_tokens=split_special), repr(text)


def test_o200k_segments_join_to_the_whole_texts_ids(o200k):
    cut = cut_pattern(o200k)
    assert cut is not None
    text = "\r\n".join(WRITTEN * 5) + "\n".join(WRITTEN * 5)
    parts = segments(text, cut, target_chars=60)
    assert len(parts) > 10
    assert [i for k, p in enumerate(parts) for i in o200k.encode(p, continued=k > 0)] == _slow(o200k).encode(text)


def _with_split(pattern: str, behavior: str, invert: bool) -> Tokenizer:
    spec = json.loads((FOLDER / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0] = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior,
                                                 "invert": invert}
    return Tokenizer(Node.root(spec, "tokenizer.json"))


@pytest.mark.parametrize("behavior", BEHAVIORS)
@pytest.mark.parametrize("invert", [False, True])
def test_every_behavior_gives_the_exact_words(o200k, behavior, invert):
    pattern = json.loads((FOLDER / "tokenizer.json").read_text())["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    tokenizer = _with_split(pattern, behavior, invert)
    assert (tokenizer._fast_regex is not None) == ((behavior, invert) in (("Isolated", False), ("Removed", True)))
    slow = _slow(tokenizer)
    for text in WRITTEN:
        assert tokenizer.words(text, START) == slow.pre_tokenizer.words(text, START), repr(text)
        assert tokenizer.encode(text) == slow.encode(text), repr(text)


@pytest.mark.parametrize("behavior, invert, words", [("Isolated", False, ["x", "b", "b"]), ("Removed", True, ["x"])])
def test_no_fast_path_where_an_empty_match_changes_the_iteration(behavior, invert, words):
    # Oniguruma: "x" (0,1); the empty match at 1 is skipped and the search resumes at 2, so "bb" never matches;
    # then empty matches at 2 and 3, between and after the gaps "b" "b". re.findall gives "x", "", "bb", "",
    # covering the text: its empty matches must send it the exact way.
    tokenizer = _with_split(r"x*|bb", behavior, invert)
    assert tokenizer._fast_regex is not None
    assert tokenizer.words("xbb", START) == words
