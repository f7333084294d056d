"""Split pre-tokenizer behaviors with and without invert (runtime/tokenizer/pre_tokenizers.py ``split``), against
tokenizers' own definitions: the SplitDelimiterBehavior doc comment of tokenizer/normalizer.rs, the tests of
pre_tokenizers/split.rs, and hand derivations from normalizer.rs ``split`` and pattern.rs ``Invert``; and matches
iterated as the Rust onig crate's ``find_iter`` (onig/src/find.rs and its tests), where Python's re differs."""

from __future__ import annotations

import re

import pytest

from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.pre_tokenizers import BEHAVIORS, MIDDLE, START, build_pre_tokenizer, split
from runtime.tokenizer.regex import compile_pattern, find_spans

DASH = re.compile(re.escape("-"))


def _split(text: str, pattern: re.Pattern, behavior: str, invert: bool) -> list[str]:
    return [t for t, _ in split((text, START), pattern, behavior, invert=invert)]


# normalizer.rs's doc comment for SplitDelimiterBehavior: "the-final--countdown" split on '-'.
@pytest.mark.parametrize("behavior, words", [
    ("Removed", ["the", "final", "countdown"]),
    ("Isolated", ["the", "-", "final", "-", "-", "countdown"]),
    ("MergedWithPrevious", ["the-", "final-", "-", "countdown"]),
    ("MergedWithNext", ["the", "-final", "-", "-countdown"]),
    ("Contiguous", ["the", "-", "final", "--", "countdown"])])
def test_each_behavior_as_tokenizers_documents_it(behavior, words):
    assert _split("the-final--countdown", DASH, behavior, False) == words


# Inverted, the spans the, -, final, -, -, countdown have is_match T F T F F T; normalizer.rs ``split`` then:
# Removed drops the T spans; MergedWithPrevious appends a T span to the span before it when that one is F;
# MergedWithNext prepends it to the span after it when that one is F (walking backwards); Contiguous joins runs
# of equal flags, which inverting does not change.
@pytest.mark.parametrize("behavior, words", [
    ("Removed", ["-", "-", "-"]),
    ("Isolated", ["the", "-", "final", "-", "-", "countdown"]),
    ("MergedWithPrevious", ["the", "-final", "-", "-countdown"]),
    ("MergedWithNext", ["the-", "final-", "-", "countdown"]),
    ("Contiguous", ["the", "-", "final", "--", "countdown"])])
def test_each_behavior_inverted(behavior, words):
    assert _split("the-final--countdown", DASH, behavior, True) == words


# pre_tokenizers/split.rs ``basic``: Split(r"\w+|[^\w\s]+", behavior, invert=true) on "How are you doing?".
@pytest.mark.parametrize("behavior, words", [
    ("Removed", ["How", "are", "you", "doing", "?"]),
    ("Isolated", ["How", " ", "are", " ", "you", " ", "doing", "?"]),
    ("MergedWithPrevious", ["How ", "are ", "you ", "doing", "?"]),
    ("MergedWithNext", ["How", " are", " you", " doing", "?"]),
    ("Contiguous", ["How", " ", "are", " ", "you", " ", "doing?"])])
def test_split_rs_own_inverted_cases(behavior, words):
    assert _split("How are you doing?", compile_pattern(r"\w+|[^\w\s]+"), behavior, True) == words


def test_removed_and_inverted_keeps_the_matches_only():
    # split.rs ``invert``: Split("Hello", Removed, invert) gives what Split(" ", Removed) gives.
    hello = re.compile("Hello")
    assert _split("Hello Hello Hello", hello, "Removed", True) == _split("Hello Hello Hello", re.compile(" "), "Removed", False)
    assert _split("xHello, Hello!", hello, "Removed", True) == ["Hello", "Hello"]
    assert _split("no match here", hello, "Removed", True) == []
    assert _split("", hello, "Removed", True) == []


def test_only_the_first_piece_of_a_text_start_keeps_start():
    pieces = split(("ab-cd", START), DASH, "Removed", invert=True)
    assert pieces == [("-", MIDDLE)]
    assert split(("-cd", START), DASH, "Isolated", invert=False) == [("-", START), ("cd", MIDDLE)]


def test_matches_are_iterated_as_oniguruma_does():
    # onig/src/find.rs tests: an empty match where the previous match ended is skipped.
    assert find_spans(re.compile(r"\d*"), "a1b2") == [(0, 0), (1, 2), (3, 4)]
    assert find_spans(re.compile(r"\d*"), "a1bbb2") == [(0, 0), (1, 2), (3, 3), (4, 4), (5, 6)]
    assert find_spans(compile_pattern(r"b|(?=,)"), "ba,") == [(0, 1), (2, 2)]
    assert [m.span() for m in re.finditer(r"\d*", "a1bbb2")] != find_spans(re.compile(r"\d*"), "a1bbb2")
    # After the empty match at 1 is skipped the search resumes at 2: the "b" at 1 is never a match.
    assert find_spans(re.compile(r"x*|b"), "xb") == [(0, 1), (2, 2)]


@pytest.mark.parametrize("pattern, text, behavior, invert, words", [
    # onig: (0,0) (1,3) (4,4); re would add (3,3), which would stop "xx" from merging into "b".
    (r"x*", "axxb", "MergedWithNext", False, ["a", "xxb"]),
    # onig never matches the "b" (see above), so it is a gap and stays; re would match and remove it.
    (r"x*|b", "xb", "Removed", False, ["b"]),
    (r"x*|b", "xb", "Removed", True, ["x"])])
def test_splits_where_empty_matches_matter(pattern, text, behavior, invert, words):
    assert _split(text, re.compile(pattern), behavior, invert) == words


@pytest.mark.parametrize("behavior", BEHAVIORS)
@pytest.mark.parametrize("invert", [False, True])
def test_the_json_spelling_reaches_the_same_split(behavior, invert):
    node = Node.root({"pre_tokenizer": {"type": "Split", "pattern": {"String": "-"}, "behavior": behavior,
                                        "invert": invert}}, "tokenizer.json")
    pre_tokenizer = build_pre_tokenizer(node.child("pre_tokenizer"))
    assert pre_tokenizer.words("the-final--countdown", START) == _split("the-final--countdown", DASH, behavior, invert)
