"""The parser's view of the tokens: the current one, a look ahead, and one-line errors naming the line."""

from __future__ import annotations

from runtime.tokenizer.chat.errors import ChatTemplateError
from runtime.tokenizer.chat.lexer import Token


class TokenStream:
    def __init__(self, tokens: list[Token]):
        self.tokens, self.pos = tokens, 0

    @property
    def current(self) -> Token:
        return self.tokens[self.pos]

    def look(self) -> Token:
        return self.tokens[min(self.pos + 1, len(self.tokens) - 1)]

    def next(self) -> Token:
        token = self.tokens[self.pos]
        if token.kind != "eof":
            self.pos += 1
        return token

    def at(self, kind: str, value: object = None) -> bool:
        token = self.current
        return token.kind == kind and (value is None or token.value == value)

    def at_name(self, *names: str) -> bool:
        return self.current.kind == "name" and self.current.value in names

    def skip_if(self, kind: str, value: object = None) -> bool:
        if self.at(kind, value):
            self.next()
            return True
        return False

    def expect(self, kind: str, value: object = None) -> Token:
        if not self.at(kind, value):
            wanted = repr(value) if value is not None else _describe_kind(kind)
            raise self.fail(f"expected {wanted}, got {describe(self.current)}")
        return self.next()

    def fail(self, message: str, line: int | None = None) -> ChatTemplateError:
        return ChatTemplateError(message, line=line if line is not None else self.current.line)


def _describe_kind(kind: str) -> str:
    return {"block_end": "end of tag '%}'", "variable_end": "end of print '}}'", "name": "a name"}.get(kind, repr(kind))


def describe(token: Token) -> str:
    if token.kind in ("name", "string", "integer", "float"):
        return repr(token.value)
    return {"eof": "end of template", "block_end": "'%}'", "variable_end": "'}}'", "data": "text",
            "block_begin": "'{%'", "variable_begin": "'{{'"}.get(token.kind, repr(token.kind))
