"""Template source -> tokens, read as Jinja2's lexer reads it in transformers' environment
(``trim_blocks=True``, ``lstrip_blocks=True``, default delimiters, ``keep_trailing_newline=False``).

Whitespace rules (Jinja2 docs, "Whitespace Control"; lexer.py's state machine):
- line breaks (``\\r\\n``, ``\\r``, ``\\n``) become ``\\n`` and one trailing line break of the source is dropped;
- trim_blocks: the first line break right after a ``%}`` or ``#}`` is removed (not after ``}}``, not after
  ``{% raw %}``); ``+%}`` keeps it;
- lstrip_blocks: spaces and tabs from the start of a line up to a ``{%`` or ``{#`` are removed when nothing else
  is on the line before the tag (not for ``{{``); ``{%+`` keeps them;
- ``{%-`` / ``{{-`` / ``{#-`` remove all whitespace before the tag, line breaks included; ``-%}`` / ``-}}`` /
  ``-#}`` all whitespace after it.
"""

from __future__ import annotations

import bisect
import re
import warnings
from typing import NamedTuple

from runtime.tokenizer.chat.errors import ChatTemplateError

_ROOT = re.compile(
    r"(.*?)(?:(?P<raw_begin>\{%(?P<raw_sign>[-+]?)\s*raw\s*(?:-%\}\s*|%\}))"
    r"|(?P<comment_begin>\{#(?P<comment_sign>[-+]?))"
    r"|(?P<block_begin>\{%(?P<block_sign>[-+]?))"
    r"|(?P<variable_begin>\{\{(?P<variable_sign>[-+]?)))", re.S)
_COMMENT_END = re.compile(r"(.*?)(?:\+#\}|-#\}\s*|#\}\n?)", re.S)
_RAW_END = re.compile(r"(.*?)\{%([-+]?)\s*endraw\s*(?:\+%\}|-%\}\s*|%\}\n?)", re.S)
_TAG_END = {"block_begin": (re.compile(r"\+%\}|-%\}\s*|%\}\n?"), "block_end"),
            "variable_begin": (re.compile(r"-\}\}\s*|\}\}"), "variable_end")}
_WHITESPACE = re.compile(r"\s+")
_FLOAT = re.compile(r"(?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+)", re.I)
_INTEGER = re.compile(r"0b(_?[0-1])+|0o(_?[0-7])+|0x(_?[\da-f])+|[1-9](_?\d)*|0(_?0)*", re.I)
_NAME = re.compile(r"\w+")
_STRING = re.compile(r"'([^'\\]*(?:\\.[^'\\]*)*)'|\"([^\"\\]*(?:\\.[^\"\\]*)*)\"", re.S)
OPERATORS = ("//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]", "(", ")", "{", "}",
             ">", "<", "=", ".", ":", "|", ",", ";")
_OPERATOR = re.compile("|".join(re.escape(op) for op in OPERATORS))
_CLOSING = {"(": ")", "[": "]", "{": "}"}


class Token(NamedTuple):
    kind: str  # data, block_begin, block_end, variable_begin, variable_end, name, string, integer, float, an operator, eof
    value: object
    line: int


def normalize_source(source: str) -> str:
    """Line breaks as ``\\n``, without the one trailing line break Jinja2 drops (keep_trailing_newline=False)."""
    lines = re.split(r"\r\n|\r|\n", source)
    if lines[-1] == "":
        del lines[-1]
    return "\n".join(lines)


def tokenize(source: str) -> list[Token]:
    return _Lexer(normalize_source(source)).run()


class _Lexer:
    def __init__(self, source: str):
        self.source = source
        self.newlines = [i for i, c in enumerate(source) if c == "\n"]
        self.tokens: list[Token] = []
        self.line_starting = True  # the text before the next tag starts a line (lstrip_blocks looks at it)

    def line(self, pos: int) -> int:
        return bisect.bisect_left(self.newlines, pos) + 1

    def fail(self, message: str, pos: int) -> ChatTemplateError:
        return ChatTemplateError(message, line=self.line(pos))

    def run(self) -> list[Token]:
        pos, source = 0, self.source
        while pos < len(source):
            m = _ROOT.match(source, pos)
            if m is None:
                self.tokens.append(Token("data", source[pos:], self.line(pos)))
                break
            kind = next(name for name in ("raw_begin", "comment_begin", "block_begin", "variable_begin") if m.group(name))
            sign = m.group(kind.replace("begin", "sign"))
            self._data(m.group(1), pos, sign, lstrip=kind != "variable_begin")
            self.line_starting = m.group().endswith("\n")
            tag_pos, pos = m.start(kind), m.end()
            if kind == "comment_begin":
                end = _COMMENT_END.match(source, pos)
                if end is None:
                    raise self.fail("missing end of comment tag '#}'", tag_pos)
                pos = self._after(end)
            elif kind == "raw_begin":
                end = _RAW_END.match(source, pos)
                if end is None:
                    raise self.fail("missing {% endraw %} for {% raw %}", tag_pos)
                self._data(end.group(1), pos, end.group(2), lstrip=True)
                pos = self._after(end)
            else:
                self.tokens.append(Token(kind, None, self.line(tag_pos)))
                pos = self._tag(kind, pos, tag_pos)
        self.tokens.append(Token("eof", None, self.line(len(source))))
        return self.tokens

    def _after(self, match: re.Match) -> int:
        self.line_starting = match.group().endswith("\n")
        return match.end()

    def _data(self, text: str, pos: int, sign: str, *, lstrip: bool) -> None:
        """Text before a tag, with the tag's whitespace control applied (Jinja2's OptionalLStrip)."""
        if sign == "-":
            text = text.rstrip()
        elif sign != "+" and lstrip:
            start = text.rfind("\n") + 1
            if (start > 0 or self.line_starting) and _WHITESPACE.fullmatch(text, start):
                text = text[:start]
        if text:
            self.tokens.append(Token("data", text, self.line(pos)))

    def _tag(self, kind: str, pos: int, tag_pos: int) -> int:
        """The expression tokens of one ``{% %}`` or ``{{ }}`` up to its end; the position after it."""
        source, (end_re, end_kind) = self.source, _TAG_END[kind]
        open_brackets: list[str] = []
        while True:
            if pos >= len(source):
                raise self.fail(f"unexpected end of template: {'{%' if kind == 'block_begin' else '{{'} is never closed",
                                tag_pos)
            if not open_brackets:  # an end delimiter inside brackets is a closing brace, as in Jinja2
                end = end_re.match(source, pos)
                if end is not None:
                    self.tokens.append(Token(end_kind, None, self.line(pos)))
                    return self._after(end)
            if m := _WHITESPACE.match(source, pos):
                pos = m.end()
                continue
            line = self.line(pos)
            if m := _FLOAT.match(source, pos):
                self.tokens.append(Token("float", float(m.group().replace("_", "")), line))
            elif m := _INTEGER.match(source, pos):
                self.tokens.append(Token("integer", int(m.group().replace("_", ""), 0), line))
            elif m := _NAME.match(source, pos):
                if not m.group().isidentifier():
                    raise self.fail(f"invalid name {m.group()!r}", pos)
                self.tokens.append(Token("name", m.group(), line))
            elif m := _STRING.match(source, pos):
                self.tokens.append(Token("string", self._unescape(m.group()[1:-1], pos), line))
            elif m := _OPERATOR.match(source, pos):
                self._balance(m.group(), open_brackets, pos)
                self.tokens.append(Token(m.group(), None, line))
            else:
                raise self.fail(f"unexpected character {source[pos]!r}", pos)
            pos = m.end()

    def _balance(self, op: str, open_brackets: list[str], pos: int) -> None:
        if op in _CLOSING:
            open_brackets.append(_CLOSING[op])
        elif op in (")", "]", "}"):
            if not open_brackets or open_brackets[-1] != op:
                expected = f", expected {open_brackets[-1]!r}" if open_brackets else ""
                raise self.fail(f"unexpected {op!r}{expected}", pos)
            open_brackets.pop()

    def _unescape(self, body: str, pos: int) -> str:
        """Python's unicode-escape rules, as Jinja2 applies them (non-ASCII characters kept as they are)."""
        try:
            with warnings.catch_warnings():  # an unknown escape such as \d stays as it is, as in Jinja2, without a warning
                warnings.simplefilter("ignore", DeprecationWarning)
                return body.encode("ascii", "backslashreplace").decode("unicode-escape")
        except UnicodeDecodeError as e:
            raise self.fail(f"bad escape in string literal ({e.reason})", pos) from None
