"""Oniguruma patterns in Python's re (runtime/tokenizer/regex.py, unicode_classes.py): every code point's class
against unicodedata, Oniguruma's own \\s, the translation of groups, options and classes, unsupported
constructs refused, and the published split patterns against hand-written scanners of the same rules."""

from __future__ import annotations

import random
import re
import unicodedata
from itertools import compress

import pytest

from runtime.tokenizer.pre_tokenizers import GPT2_PATTERN
from runtime.tokenizer.regex import UnsupportedPattern, compile_pattern, translate

N_CODE_POINTS = 0x110000
CATEGORY = list(map(unicodedata.category, map(chr, range(N_CODE_POINTS))))
# Oniguruma's \s (doc/RE): U+0009-U+000D, U+0085 and the categories Zs, Zl, Zp.
ONIGURUMA_SPACE = {chr(cp) for cp, cat in enumerate(CATEGORY) if cat in ("Zs", "Zl", "Zp")} | set("\t\n\x0b\x0c\r\x85")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _mask(members) -> bytes:
    """One byte per code point: 1 where ``members(cp)``."""
    return bytes(map(members, range(N_CODE_POINTS)))


def _ranges_mask(ranges) -> bytes:
    mask = bytearray(N_CODE_POINTS)
    for low, high in ranges:
        mask[low: high + 1] = b"\x01" * (high - low + 1)
    return bytes(mask)


def _regex_mask(pattern: str, code_points) -> dict[int, bool]:
    regex = re.compile(translate(pattern))
    return {cp: bool(regex.fullmatch(chr(cp))) for cp in code_points}


def _boundaries(ranges) -> set[int]:
    """Where a class's ranges start and end, and their neighbours: a wrong range shows there."""
    return {cp for low, high in ranges for cp in (low - 1, low, high, high + 1) if 0 <= cp < N_CODE_POINTS}


@pytest.mark.parametrize("pattern, categories", [
    (r"\p{L}", "Lu Ll Lt Lm Lo"), (r"\p{N}", "Nd Nl No"), (r"\p{Lu}", "Lu"), (r"\p{Nd}", "Nd"), (r"\d", "Nd"),
    (r"\p{M}", "Mn Mc Me"), (r"\p{P}", "Pc Pd Ps Pe Pi Pf Po"), (r"\p{S}", "Sm Sc Sk So"), (r"\p{Letter}", "Lu Ll Lt Lm Lo"),
    (r"\p{C}", "Cc Cf Cs Co Cn"), (r"\w", "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc")])
def test_every_code_point_is_in_its_unicode_class(pattern, categories):
    wanted = set(categories.split())
    want = _mask(lambda cp: CATEGORY[cp] in wanted)
    ranges = _class_ranges(pattern)
    assert _ranges_mask(ranges) == want  # all 1,114,112 code points
    negated = pattern.replace("\\p", "\\P") if "\\p" in pattern else pattern.upper()
    for p, expect in ((pattern, 1), (negated, 0)):  # the compiled class at every range edge
        got = _regex_mask(p, _boundaries(ranges))
        assert all(matched == (want[cp] == expect) for cp, matched in got.items()), p


def _class_ranges(pattern: str):
    from runtime.tokenizer.regex import _Translator  # the set a class escape stands for
    return _Translator(pattern)._escape(in_class=True)


def test_whole_code_space_through_the_compiled_letter_class():
    everything = "".join(map(chr, range(N_CODE_POINTS)))
    rest = re.compile(translate(r"\p{L}")).sub("", everything)
    assert rest == "".join(compress(everything, _mask(lambda cp: CATEGORY[cp][0] != "L")))


def test_space_is_oniguruma_space_not_pythons():
    ranges = _class_ranges(r"\s")
    assert {chr(cp) for low, high in ranges for cp in range(low, high + 1)} == ONIGURUMA_SPACE
    got = _regex_mask(r"\s", range(0x3001))
    assert {chr(cp) for cp, m in got.items() if m} == {c for c in ONIGURUMA_SPACE if ord(c) <= 0x3000}
    assert re.match(r"\s", "\x1c") and not re.match(translate(r"\s"), "\x1c")  # Python's own \s differs


def test_negated_and_combined_classes_are_computed_as_sets():
    space = _ranges_mask(_class_ranges(r"\s"))
    letter, number = _ranges_mask(_class_ranges(r"\p{L}")), _ranges_mask(_class_ranges(r"\p{N}"))
    other = bytes(1 - (s | a | n) for s, a, n in zip(space, letter, number))
    assert _ranges_mask(_class(r"[^\s\p{L}\p{N}]")) == other
    line_break = _ranges_mask(((10, 10), (13, 13)))
    assert _ranges_mask(_class(r"[^\r\n\p{L}\p{N}]")) == bytes(1 - (b | a | n) for b, a, n in zip(line_break, letter, number))
    assert _chars(_class(r"[a-w&&[^c-g]z]")) == set("abhijklmnopqrstuvw")  # Oniguruma's doc/RE example
    assert _class(r"[\p{L}&&\p{Lu}]") == _class_ranges(r"\p{Lu}")
    assert _class(r"[\p{^L}]") == _class_ranges(r"\P{L}")
    assert _chars(_class(r"[\x{1F600}-\x{1F602}\u00e9\-]")) == {"\U0001f600", "\U0001f601", "\U0001f602", "é", "-"}
    assert re.fullmatch(translate(r"[^\s\p{L}\p{N}]+"), "!€\u0301🙂") and not re.search(translate(r"[^\s\p{L}\p{N}]"), "a1 ")


def _class(pattern: str):
    from runtime.tokenizer.regex import _Translator

    return _Translator(pattern)._class()


def _chars(ranges) -> set[str]:
    return {chr(cp) for low, high in ranges for cp in range(low, high + 1)}


def test_groups_options_and_quantifiers():
    assert re.fullmatch(translate(r"a(?i)b|c"), "aB") and re.fullmatch(translate(r"a(?i)b|c"), "aC")
    assert not re.fullmatch(translate(r"a(?i)b|c"), "C")  # the isolated option covers the rest of its group
    assert re.findall(translate(r"(x)(y)"), "xyxy") == ["xy", "xy"]  # captures become non-capturing
    assert re.fullmatch(translate(r"(?m:.)"), "\n") and not re.fullmatch(translate("."), "\n")  # Ruby's m = dotall
    assert re.findall(translate(r"a*+a"), "aaa") == []  # possessive
    assert re.findall(translate(r"(?>ab|a)c"), "abc ac") == ["abc", "ac"]
    assert re.findall(translate(r"\p{N}{1,3}"), "12345") == ["123", "45"]
    assert re.findall(translate(r"x{,2}"), "xxx") == ["xx", "x", ""]
    assert re.findall(translate(r"^a|b$"), "a\nab\nb") == ["a", "a", "b", "b"]  # line anchors
    assert re.findall(translate(r"(?i:'s)"), "'S 'ſ 's") == ["'S", "'ſ", "'s"]  # Unicode case folding: ſ -> s


@pytest.mark.parametrize("pattern, words", [
    (r"(a)\1", "backreferences"), (r"\bword", "word boundaries"), (r"\p{Han}", "scripts"), (r"(?x) a", "option"),
    (r"a{2}?", "quantifier"), (r"a{1,2}+", "quantifier"), (r"\xC3\xA9", "raw UTF-8 byte"), (r"[a", "missing ']'"),
    (r"(a", "missing ')'"), (r"a)", "unbalanced"), (r"(?<=a)\K", "\\K")])
def test_unsupported_constructs_are_refused_by_name(pattern, words):
    with pytest.raises(UnsupportedPattern, match=re.escape(words)):
        compile_pattern(pattern)


# ---- the split patterns against scanners written from their rules ----

def _letter(c):
    return unicodedata.category(c)[0] == "L"


def _number(c):
    return unicodedata.category(c)[0] == "N"


def _space(c):
    return c in ONIGURUMA_SPACE


def _other(c):
    return not (_letter(c) or _number(c) or _space(c))


def _folds_to(c, letter):
    return c == letter or c.lower() == letter or c.upper() == letter.upper()


def _run(text, i, test):
    while i < len(text) and test(text[i]):
        i += 1
    return i


def _spaces(text, i):
    """\\s+(?!\\S) then \\s+: the run, less its last character when a non-space follows (never empty)."""
    end = _run(text, i, _space)
    return end if end == len(text) or end - i == 1 else end - 1


def _contraction(text, i, fold):
    if text[i] != "'":
        return None
    for suffix in ("s", "t", "re", "ve", "m", "ll", "d"):  # the pattern's order
        part = text[i + 1: i + 1 + len(suffix)]
        if len(part) == len(suffix) and all((_folds_to(c, s) if fold else c == s) for c, s in zip(part, suffix)):
            return i + 1 + len(suffix)
    return None


def gpt2_scan(text):
    pieces, i = [], 0
    while i < len(text):
        end = _contraction(text, i, fold=False)
        j = i + (text[i] == " ")
        for test in (_letter, _number, _other):
            if end is None and j < len(text) and test(text[j]):
                end = _run(text, j, test)
        if end is None:
            end = _spaces(text, i)
        pieces.append(text[i:end])
        i = end
    return pieces


def llama3_scan(text, max_digits=3):
    pieces, i = [], 0
    while i < len(text):
        end = _contraction(text, i, fold=True)
        if end is None and text[i] not in "\r\n" and not _letter(text[i]) and not _number(text[i]) \
                and i + 1 < len(text) and _letter(text[i + 1]):
            end = _run(text, i + 1, _letter)  # [^\r\n\p{L}\p{N}]?\p{L}+ with its prefix
        if end is None and _letter(text[i]):
            end = _run(text, i, _letter)
        if end is None and _number(text[i]):
            end = min(_run(text, i, _number), i + max_digits)
        j = i + (text[i] == " ")
        if end is None and j < len(text) and _other(text[j]):
            end = _run(text, _run(text, j, _other), lambda c: c in "\r\n")
        if end is None:  # \s*[\r\n]+: the space run up to its last line break
            run = _run(text, i, _space)
            breaks = [k for k in range(i, run) if text[k] in "\r\n"]
            end = breaks[-1] + 1 if breaks else _spaces(text, i)
        pieces.append(text[i:end])
        i = end
    return pieces


KINDS = ["a", "Z", "é", "ß", "ſ", "K", "S", "Ж", "中", "ǅ", "ʰ", "1", "٣", "²", "Ⅻ", "½", ".", ",", "!", "-", "'", '"', "(",
         "$", "€", "+", "🙂", "👩", "\u200d", "\ufe0f", "\u0301", "\u093f", " ", " ", " ", "\t", "\n", "\r", "\r\n",
         "\x0b", "\x0c", "\x85", "\xa0", "\u2003", "\u3000", "\u2028", "\x1c", "\x00", "'s", "'S", "'ll", "'Re", "'ſ"]


def _random_texts(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(KINDS) for _ in range(rng.randrange(0, 40))) for _ in range(n)]


@pytest.mark.parametrize("pattern, scan", [(GPT2_PATTERN, gpt2_scan), (LLAMA3_PATTERN, llama3_scan),
                                           (QWEN2_PATTERN, lambda t: llama3_scan(t, max_digits=1))])
def test_split_patterns_match_a_scanner_of_their_rules(pattern, scan):
    regex = compile_pattern(pattern)
    for text in _random_texts(1500, seed=len(pattern)) + ["  two\t\n\n x", "a \r\n\r\nb", "'S'ſ'Ll 12345 ..\n\n"]:
        assert regex.findall(text) == scan(text), repr(text)
