"""gpt-oss's o200k split pattern through the Oniguruma -> re translation (runtime/tokenizer/regex.py,
unicode_classes.py): its case classes over every code point against unicodedata, hand-picked words (CamelCase,
marks, titlecase digraphs, contractions, digit groups, punctuation runs), the contraction suffixes' case folding
over every code point, and the whole pattern against a scanner written from its rules on random texts."""

from __future__ import annotations

import json
import random
import re
import unicodedata

import pytest

from runtime.tokenizer.regex import compile_pattern, translate
from tests.paths import FIXTURE_ROOT

FIXTURE = FIXTURE_ROOT / "tokenizers" / "o200k-style" / "tokenizer.json"
UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
SUFFIXES = ("s", "t", "re", "ve", "m", "ll", "d")


@pytest.fixture(scope="module")
def o200k() -> re.Pattern:
    spec = json.loads(FIXTURE.read_text())
    return compile_pattern(spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"])


def test_the_fixture_spells_tiktokens_o200k_pattern(o200k):
    contraction = "(?i:" + "|".join("'" + s for s in SUFFIXES) + ")?"
    pattern = "|".join([rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{contraction}",
                        rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{contraction}",
                        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
    assert o200k.pattern == translate(pattern)  # so the scanner below checks the gpt-oss pattern itself


@pytest.mark.parametrize("cls, categories", [(UPPER, {"Lu", "Lt", "Lm", "Lo", "Mn", "Mc", "Me"}),
                                             (LOWER, {"Ll", "Lm", "Lo", "Mn", "Mc", "Me"})])
def test_the_case_classes_hold_exactly_their_categories(cls, categories):
    everything = "".join(map(chr, range(0x110000)))
    kept = re.compile(translate(cls) + "+").findall(everything)
    assert "".join(kept) == "".join(c for c in everything if unicodedata.category(c) in categories)


@pytest.mark.parametrize("text, words", [
    ("CamelCaseWord", ["Camel", "Case", "Word"]), ("camelCase iPhone", ["camel", "Case", " i", "Phone"]),
    ("HTTPServer ABC", ["HTTPServer", " ABC"]),  # upper run then lower run is one word; an upper run alone too
    ("nai\u0308ve cafe\u0301", ["nai\u0308ve", " cafe\u0301"]),  # a combining mark (\p{M}) stays with its letter
    (" \u0301x", [" \u0301x"]),  # ... and a mark can begin a word
    ("\u01c5emal a\u01c5b \u01c8", ["\u01c5emal", " a", "\u01c5b", " \u01c8"]),  # Lt digraphs ǅ, ǈ start a word
    ("\u02b0a \u3042\u3044", ["\u02b0a", " \u3042\u3044"]),  # Lm, Lo are in both case classes
    ("don't DON'T I'LL we'Re it'sy", ["don't", " DON'T", " I'LL", " we'Re", " it's", "y"]),
    ("'s x'S", ["'s", " x'S"]), ("x'\u017f", ["x'\u017f"]),  # ſ folds to s, as in Oniguruma's (?i)
    ("12345 \u0663\u0664 \u216b\u00bd", ["123", "45", " ", "\u0663\u0664", " ", "\u216b\u00bd"]),
    ("a://b", ["a", "://", "b"]), ("x:\n/y", ["x", ":\n/", "y"]), ("end.\r\n\r\nNext", ["end", ".\r\n\r\n", "Next"]),
    ("a  \n\n b\t", ["a", "  \n\n", " b", "\t"]), ("x\r\n  y", ["x", "\r\n", " ", " y"]),
])
def test_words(o200k, text, words):
    assert o200k.findall(text) == words


def test_contraction_suffixes_fold_case_as_oniguruma_does():
    """Oniguruma's (?i) matches a character whose case folding (Unicode CaseFolding.txt; str.casefold) equals the
    pattern's. No character folds to more than one of the suffixes' letters (so no multi-character fold applies)."""
    everything = "".join(map(chr, range(0x110000)))
    folds = dict(zip(everything, map(str.casefold, everything)))
    for letter in set("".join(SUFFIXES)):
        matched = re.compile(translate(f"(?i:{letter})")).findall(everything)
        assert matched == [c for c, f in folds.items() if f == letter], letter
    assert not [c for c, f in folds.items() if len(f) > 1 and any(f in s for s in SUFFIXES)]


# ---- the pattern against a scanner written from its rules ----

def _upper(c):
    return unicodedata.category(c) in ("Lu", "Lt", "Lm", "Lo") or unicodedata.category(c)[0] == "M"


def _lower(c):
    return unicodedata.category(c) in ("Ll", "Lm", "Lo") or unicodedata.category(c)[0] == "M"


def _letter(c):
    return unicodedata.category(c)[0] == "L"


def _number(c):
    return unicodedata.category(c)[0] == "N"


def _space(c):  # Oniguruma's \s
    return c in "\t\n\x0b\x0c\r\x85" or unicodedata.category(c) in ("Zs", "Zl", "Zp")


def _run(text, i, test):
    while i < len(text) and test(text[i]):
        i += 1
    return i


def _contraction(text, i):
    """The end of the first suffix (in the pattern's order) at ``i``, case folded; ``i`` when none."""
    for suffix in SUFFIXES:
        part = text[i: i + 1 + len(suffix)]
        if part[:1] == "'" and len(part) == 1 + len(suffix) and all(c.casefold() == s for c, s in zip(part[1:], suffix)):
            return i + len(part)
    return i


def _cased_word(text, i):
    """The two letter alternatives, each with the optional prefix tried first: [^\\r\\n L N]? then
    upper* lower+ (backtracking the greedy upper* to the last place where lower+ can start) or upper+ lower*."""
    can_prefix = text[i] not in "\r\n" and not _letter(text[i]) and not _number(text[i])
    for start in ((i + 1, i) if can_prefix else (i,)):
        upper_end = _run(text, start, _upper)
        for k in range(upper_end, start - 1, -1):
            if k < len(text) and _lower(text[k]):
                return _contraction(text, _run(text, k, _lower))
    for start in ((i + 1, i) if can_prefix else (i,)):
        upper_end = _run(text, start, _upper)
        if upper_end > start:
            return _contraction(text, _run(text, upper_end, _lower))
    return None


def o200k_scan(text):
    pieces, i = [], 0
    while i < len(text):
        end = _cased_word(text, i)
        if end is None and _number(text[i]):
            end = min(_run(text, i, _number), i + 3)
        j = i + (text[i] == " ")
        other = lambda c: not (_letter(c) or _number(c) or _space(c))  # noqa: E731
        if end is None and j < len(text) and other(text[j]):
            end = _run(text, _run(text, j, other), lambda c: c in "\r\n/")
        if end is None:  # \s*[\r\n]+ (up to the run's last line break), \s+(?!\S), \s+
            run = _run(text, i, _space)
            breaks = [k for k in range(i, run) if text[k] in "\r\n"]
            end = breaks[-1] + 1 if breaks else (run if run == len(text) or run - i == 1 else run - 1)
        pieces.append(text[i:end])
        i = end
    return pieces


KINDS = ["a", "b", "Z", "Q", "é", "É", "ß", "ſ", "K", "S", "T", "L", "Ж", "ж", "中", "ǅ", "ǈ", "ʰ", "ー", "\u0301", "\u093f",
         "\u20dd", "1", "٣", "²", "Ⅻ", "½", ".", ",", "!", "-", "/", "'", '"', "(", "$", "€", "🙂", "\u200d", " ", " ", " ",
         "\t", "\n", "\r", "\r\n", "\x0b", "\x85", "\xa0", "\u3000", "\u2028", "\x1c", "'s", "'S", "'ll", "'Re", "'VE",
         "'ſ", "'t", "'D", "'M", "Camel", "Case", "HTTP", "iPhone", "//", "\n/"]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_pattern_matches_a_scanner_of_its_rules(o200k, seed):
    rng = random.Random(seed)
    texts = ["".join(rng.choice(KINDS) for _ in range(rng.randrange(0, 40))) for _ in range(1500)]
    for text in texts + ["ÉCOLE E\u0301COLE", "A\u0301\u0301b", "\u0301\u0301", "aB'sC'LL", "x'", "''s", "1234'S"]:
        assert o200k.findall(text) == o200k_scan(text), repr(text)
