"""Oniguruma patterns (the Split and Replace regexes of tokenizer.json) translated to Python's ``re``.

Hugging Face's tokenizers compile these with Oniguruma (its default syntax, Ruby's: kkos/oniguruma doc/RE).
The translation keeps the pattern's structure and rewrites what ``re`` reads differently:

- ``\\p{L}`` ``\\P{N}`` ``\\p{^Lu}``, ``\\s \\S \\d \\D \\w \\W \\h \\H`` and every ``[...]`` class become explicit
  code-point ranges (unicode_classes.py), so ``[^\\s\\p{L}\\p{N}]`` is computed as a set, Oniguruma's
  nested classes and ``&&`` intersections included;
- capturing groups become non-capturing (``findall`` must return whole matches; no backreferences);
- an isolated option ``(?i)`` covers the rest of its group, as in Oniguruma (Python only allows it first);
  Ruby's ``m`` option is Python's ``s`` (dot matches newline); ``^`` and ``$`` are line anchors;
- possessive quantifiers and atomic groups stay (Python 3.11 has them).

Matches are iterated as tokenizers iterates them (``find_spans``: the Rust ``onig`` crate's ``find_iter``),
which differs from ``re.finditer`` after a match where the pattern can also match empty.

Anything else (backreferences, subexpression calls, word boundaries, scripts such as ``\\p{Han}``, raw
``\\xHH`` bytes above 0x7F) raises ``UnsupportedPattern`` naming the construct.
"""

from __future__ import annotations

import re

from runtime.tokenizer import unicode_classes as uc


class UnsupportedPattern(ValueError):
    pass


_CONTROL = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07, "e": 0x1B}
_SETS = {"s": uc.white_space, "d": lambda: uc.property_ranges("Nd"), "w": uc.word, "h": lambda: uc.HEX_DIGITS}
_POSIX = {"alpha": ("L", "M"), "alnum": ("L", "M", "Nd"), "digit": ("Nd",), "upper": ("Lu",), "lower": ("Ll",),
          "punct": ("P",), "word": ("L", "M", "Nd", "Pc"), "cntrl": ("Cc", "Cf", "Cn", "Co", "Cs")}
_OPTIONS = {"i": "i", "m": "s"}  # Oniguruma's (Ruby's) m = dot matches newline = Python's s


def translate(pattern: str) -> str:
    """The ``re`` pattern matching exactly what Oniguruma matches with ``pattern``."""
    return _Translator(pattern).run()


def compile_pattern(pattern: str) -> re.Pattern:
    """Raises UnsupportedPattern (with the reason) for a construct ``re`` cannot express the same way."""
    translated = translate(pattern)
    try:
        return re.compile(translated)
    except re.error as e:
        raise UnsupportedPattern(f"the pattern does not compile as a Python regex ({e})") from None


def find_spans(pattern: re.Pattern, text: str) -> list[tuple[int, int]]:
    """(start, end) of every match, as rust-onig's ``FindMatches::next`` (onig/src/find.rs, onig >= 6.1, which
    tokenizers uses) yields them: an empty match ending where the last match ended is skipped and the search
    resumes one character later. ``re.finditer`` reports that empty match and then looks for a non-empty one
    at the same place; without empty matches the two iterate alike, so ``finditer`` answers unless it finds one."""
    spans = [m.span() for m in pattern.finditer(text)]
    if all(start != end for start, end in spans):
        return spans
    spans, at, last_end = [], 0, None
    while at <= len(text):
        m = pattern.search(text, at)
        if m is None:
            break
        start, end = m.span()
        if start == end == last_end:
            at = end + 1
            continue
        spans.append((start, end))
        at = last_end = end
    return spans


class _Translator:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def run(self) -> str:
        out = self._sequence(depth=0)
        if self.i < len(self.p):
            raise UnsupportedPattern(f"unbalanced ')' at offset {self.i}")
        return out

    def _peek(self, text: str) -> bool:
        return self.p.startswith(text, self.i)

    def _sequence(self, *, depth: int) -> str:
        """Atoms up to the enclosing group's ')' (not consumed) or the end."""
        out = []
        while self.i < len(self.p):
            c = self.p[self.i]
            if c == ")":
                if depth == 0:
                    raise UnsupportedPattern(f"unbalanced ')' at offset {self.i}")
                break
            if c == "(":
                out.append(self._group(depth=depth))
            elif c == "[":
                out.append(uc.char_class(self._class()))
            elif c == "\\":
                out.append(self._escape_outside())
            elif c == "^":
                self.i += 1
                out.append("(?m:^)")
            elif c == "$":
                self.i += 1
                out.append("(?m:$)")
            elif c == "{":
                out.append(self._interval())
            else:
                self.i += 1
                out.append(c if c in "|*+?." else re.escape(c))
        return "".join(out)

    def _interval(self) -> str:
        m = re.compile(r"\{(\d*)(?:,(\d*))?\}").match(self.p, self.i)
        if not m or (m.group(1) == "" and not m.group(2)):
            self.i += 1
            return "\\{"  # an unpaired brace is a literal in Oniguruma
        self.i = m.end()
        following = self.p[self.i: self.i + 1]
        if following == "+" or (following == "?" and m.group(2) is None):
            # Oniguruma reads {n,m}+ as a repeat of a repeat and {n}? as optional; Python otherwise.
            raise UnsupportedPattern(f"quantifier {m.group(0)}{following} at offset {m.start()}")
        return m.group(0)

    def _group(self, *, depth: int) -> str:
        self.i += 1  # "("
        if self._peek("?#"):
            end = self.p.find(")", self.i)
            if end < 0:
                raise UnsupportedPattern("unterminated comment (?#")
            self.i = end + 1
            return ""
        opener = "(?:"  # capturing groups become non-capturing
        if self._peek("?"):
            for head in ("?:", "?=", "?!", "?<=", "?<!", "?>"):
                if self._peek(head):
                    self.i += len(head)
                    opener = "(" + head
                    break
            else:
                named = re.compile(r"\?(?:<(\w+)>|'(\w+)')").match(self.p, self.i)
                options = re.compile(r"\?([a-zA-Z]*)(?:-([a-zA-Z]*))?([:)])").match(self.p, self.i)
                if named:
                    self.i = named.end()
                elif options:
                    self.i = options.end()
                    flags = self._flags(options.group(1), options.group(2) or "", at=options.start())
                    if options.group(3) == ")":  # isolated: up to the end of the enclosing group
                        return f"(?{flags}:" + self._sequence(depth=depth) + ")"
                    opener = f"(?{flags}:"
                else:
                    raise UnsupportedPattern(f"group syntax at offset {self.i - 1}")
        inner = self._sequence(depth=depth + 1)
        if not self._peek(")"):
            raise UnsupportedPattern("missing ')'")
        self.i += 1
        return opener + inner + ")"

    def _flags(self, on: str, off: str, *, at: int) -> str:
        bad = sorted(set(on + off) - set(_OPTIONS))
        if bad:
            raise UnsupportedPattern(f"option {''.join(bad)!r} at offset {at} (supported: i, m)")
        on, off = "".join(_OPTIONS[c] for c in on), "".join(_OPTIONS[c] for c in off)
        return on + (f"-{off}" if off else "")

    # ---- escapes ----

    def _escape_outside(self) -> str:
        start = self.i
        c = self.p[self.i + 1: self.i + 2]
        if c in ("A", "z", "Z"):
            self.i += 2
            return {"A": "\\A", "z": "\\Z", "Z": "(?=\\n?\\Z)"}[c]
        value = self._escape(in_class=False)
        if isinstance(value, int):
            return uc.class_body(((value, value),))
        if not isinstance(value, tuple):
            raise UnsupportedPattern(f"escape at offset {start}")
        return uc.char_class(value)

    def _escape(self, *, in_class: bool) -> int | uc.Ranges:
        """At a backslash: a code point (int) or a set of ranges."""
        start = self.i
        c = self.p[self.i + 1: self.i + 2]
        self.i += 2
        if not c:
            raise UnsupportedPattern("pattern ends with a backslash")
        if c in "pP":
            m = re.compile(r"\{(\^?)([^}]*)\}").match(self.p, self.i)
            if not m:
                raise UnsupportedPattern(f"\\{c} without {{name}} at offset {start}")
            self.i = m.end()
            name = uc.canonical_property(m.group(2))
            if name is None:
                raise UnsupportedPattern(f"\\{c}{{{m.group(2)}}}: only general categories (L, Lu, N, Nd, P, S, Z, "
                                         f"...) can be computed from Python's unicodedata, not scripts or binary properties")
            ranges = uc.property_ranges(name)
            return uc.complement(ranges) if (c == "P") != bool(m.group(1)) else ranges
        if c.lower() in _SETS:
            ranges = _SETS[c.lower()]()
            return uc.complement(ranges) if c.isupper() else ranges
        if c in _CONTROL:
            return _CONTROL[c]
        if c == "b" and in_class:
            return 0x08
        if c == "x":
            m = re.compile(r"\{([0-9a-fA-F]{1,8})\}|([0-9a-fA-F]{1,2})").match(self.p, self.i)
            if not m:
                raise UnsupportedPattern(f"\\x without hex digits at offset {start}")
            self.i = m.end()
            value = int(m.group(1) or m.group(2), 16)
            if m.group(2) and value > 0x7F:
                raise UnsupportedPattern(f"\\x{m.group(2)} at offset {start}: Oniguruma reads it as a raw UTF-8 "
                                         f"byte; write the character or \\x{{HHHH}}")
            return value
        if c == "u":
            m = re.compile(r"[0-9a-fA-F]{4}").match(self.p, self.i)
            if not m:
                raise UnsupportedPattern(f"\\u needs 4 hex digits at offset {start}")
            self.i = m.end()
            return int(m.group(0), 16)
        if c.isascii() and c.isalnum():
            raise UnsupportedPattern(f"\\{c} at offset {start} (backreferences, calls, word boundaries and "
                                     f"anchors other than \\A \\z \\Z are not supported)")
        return ord(c)  # an escaped punctuation, space or non-ASCII character is itself

    # ---- character classes ----

    def _class(self) -> uc.Ranges:
        """At '[': the set the class matches (nested classes, && intersections and negation computed)."""
        open_at = self.i
        self.i += 1
        negate = self._peek("^")
        if negate:
            self.i += 1
        operands: list[uc.Ranges] = []
        items: list[uc.Ranges] = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise UnsupportedPattern(f"missing ']' for the class at offset {open_at}")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if self._peek("&&"):
                self.i += 2
                operands.append(uc.union(*items))
                items = []
                continue
            if self._peek("[:"):
                items.append(self._posix())
                continue
            if c == "[":
                items.append(self._class())
                continue
            low = self._class_atom()
            if isinstance(low, int) and self._peek("-") and self.p[self.i + 1: self.i + 2] not in ("]", ""):
                self.i += 1
                high = self._class_atom()
                if not isinstance(high, int) or high < low:
                    raise UnsupportedPattern(f"bad range in the class at offset {open_at}")
                items.append(((low, high),))
            else:
                items.append(((low, low),) if isinstance(low, int) else low)
        value = uc.union(*items)
        for operand in operands:
            value = uc.intersection(operand, value)
        return uc.complement(value) if negate else value

    def _class_atom(self) -> int | uc.Ranges:
        if self.p[self.i] == "\\":
            return self._escape(in_class=True)
        self.i += 1
        return ord(self.p[self.i - 1])

    def _posix(self) -> uc.Ranges:
        m = re.compile(r"\[:(\^?)(\w+):\]").match(self.p, self.i)
        if not m:
            raise UnsupportedPattern(f"bad POSIX bracket at offset {self.i}")
        self.i = m.end()
        name = m.group(2)
        if name == "space":
            ranges = uc.white_space()
        elif name == "xdigit":
            ranges = uc.HEX_DIGITS
        elif name == "blank":
            ranges = uc.union(((0x09, 0x09),), uc.property_ranges("Zs"))
        elif name == "ascii":
            ranges = ((0, 0x7F),)
        elif name in _POSIX:
            ranges = uc.union(*(uc.property_ranges(p) for p in _POSIX[name]))
        else:
            raise UnsupportedPattern(f"POSIX bracket [:{name}:] is not supported")
        return uc.complement(ranges) if m.group(1) else ranges
