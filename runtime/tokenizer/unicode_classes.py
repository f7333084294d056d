"""Unicode property classes for Python's ``re``, built from ``unicodedata``.

Python's ``re`` has no ``\\p{L}``; tokenizer.json patterns are written for Oniguruma (the regex engine of
Hugging Face's tokenizers). Every class here is a list of code-point ranges computed from
``unicodedata.category`` (Python 3.11: Unicode 14.0), so ``\\p{L}`` is exactly the code points whose
general category is Lu, Ll, Lt, Lm or Lo. Oniguruma's own classes (doc/RE, "3. Character types"):

    \\s  U+0009-U+000D, U+0085, and the categories Zs, Zl, Zp (the White_Space property;
        Python's own \\s also takes U+001C-U+001F, which Oniguruma does not)
    \\d  Nd          \\w  L, M, N, Pc          \\h  [0-9a-fA-F]
"""

from __future__ import annotations

import operator
import unicodedata
from functools import lru_cache
from itertools import compress

MAX_CODE_POINT = 0x10FFFF

# General category groups (Unicode's one-letter names) and the long names Oniguruma also accepts.
GROUPS = {"L": ("Lu", "Ll", "Lt", "Lm", "Lo"), "LC": ("Lu", "Ll", "Lt"), "M": ("Mn", "Mc", "Me"),
          "N": ("Nd", "Nl", "No"), "P": ("Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"), "S": ("Sm", "Sc", "Sk", "So"),
          "Z": ("Zs", "Zl", "Zp"), "C": ("Cc", "Cf", "Cs", "Co", "Cn")}
CATEGORIES = tuple(c for group in ("L", "M", "N", "P", "S", "Z", "C") for c in GROUPS[group])
LONG_NAMES = {
    "letter": "L", "casedletter": "LC", "uppercaseletter": "Lu", "lowercaseletter": "Ll", "titlecaseletter": "Lt",
    "modifierletter": "Lm", "otherletter": "Lo", "mark": "M", "combiningmark": "M", "nonspacingmark": "Mn",
    "spacingmark": "Mc", "enclosingmark": "Me", "number": "N", "decimalnumber": "Nd", "digit": "Nd",
    "letternumber": "Nl", "othernumber": "No", "punctuation": "P", "punct": "P", "connectorpunctuation": "Pc",
    "dashpunctuation": "Pd", "openpunctuation": "Ps", "closepunctuation": "Pe", "initialpunctuation": "Pi",
    "finalpunctuation": "Pf", "otherpunctuation": "Po", "symbol": "S", "mathsymbol": "Sm", "currencysymbol": "Sc",
    "modifiersymbol": "Sk", "othersymbol": "So", "separator": "Z", "spaceseparator": "Zs", "lineseparator": "Zl",
    "paragraphseparator": "Zp", "other": "C", "control": "Cc", "cntrl": "Cc", "format": "Cf", "surrogate": "Cs",
    "privateuse": "Co", "unassigned": "Cn",
}

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive (low, high) code-point ranges


@lru_cache(maxsize=None)
def _by_category() -> dict[str, Ranges]:
    """Every code point's general category, as ranges per category (the 1.1M lookups and the comparison of
    neighbours run inside map / compress: ~0.25 s)."""
    categories = list(map(unicodedata.category, map(chr, range(MAX_CODE_POINT + 1))))
    starts = [0, *compress(range(1, MAX_CODE_POINT + 1), map(operator.ne, categories, categories[1:]))]
    found: dict[str, list[tuple[int, int]]] = {c: [] for c in CATEGORIES}
    for start, end in zip(starts, [*starts[1:], MAX_CODE_POINT + 1]):
        found[categories[start]].append((start, end - 1))
    return {c: tuple(r) for c, r in found.items()}


def canonical_property(name: str) -> str | None:
    """A property name as Oniguruma compares it (case, spaces, '-' and '_' ignored) -> a category or
    group name of ours; None when it is not a general category (scripts, binary properties)."""
    key = "".join(ch for ch in name.lower() if ch not in " -_")
    if key == "any":
        return "Any"
    for short in (*GROUPS, *CATEGORIES):
        if key == short.lower():
            return short
    return LONG_NAMES.get(key)


@lru_cache(maxsize=None)
def property_ranges(name: str) -> Ranges:
    """Ranges of a canonical property name (``canonical_property``'s answer)."""
    if name == "Any":
        return ((0, MAX_CODE_POINT),)
    table = _by_category()
    return union(*(table[c] for c in GROUPS.get(name, (name,))))


def union(*parts: Ranges) -> Ranges:
    merged: list[list[int]] = []
    for low, high in sorted(r for part in parts for r in part):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple((low, high) for low, high in merged)


def complement(ranges: Ranges) -> Ranges:
    out, next_low = [], 0
    for low, high in ranges:
        if low > next_low:
            out.append((next_low, low - 1))
        next_low = high + 1
    if next_low <= MAX_CODE_POINT:
        out.append((next_low, MAX_CODE_POINT))
    return tuple(out)


def intersection(a: Ranges, b: Ranges) -> Ranges:
    return complement(union(complement(a), complement(b)))


@lru_cache(maxsize=None)
def white_space() -> Ranges:
    """Oniguruma's \\s: U+0009-U+000D, U+0085 and the separators Zs, Zl, Zp."""
    return union(((0x09, 0x0D), (0x85, 0x85)), property_ranges("Z"))


@lru_cache(maxsize=None)
def word() -> Ranges:
    """Oniguruma's \\w for Unicode: Letter, Mark, Number, Connector_Punctuation."""
    return union(property_ranges("L"), property_ranges("M"), property_ranges("N"), property_ranges("Pc"))


HEX_DIGITS: Ranges = ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))


def class_body(ranges: Ranges) -> str:
    """The inside of a ``re`` character class matching exactly ``ranges`` (every code point escaped)."""
    return "".join(_escape(low) if low == high else f"{_escape(low)}-{_escape(high)}" for low, high in ranges)


def _escape(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def char_class(ranges: Ranges) -> str:
    """A ``re`` character class matching exactly ``ranges`` (one that matches nothing when empty)."""
    return f"[{class_body(ranges)}]" if ranges else "[^\\u0000-\\U0010ffff]"
