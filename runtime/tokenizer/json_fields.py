"""Reading tokenizer.json's nested objects with one-line errors that name the file and the field.

    node = Node.root(data, "gpt2/tokenizer.json")
    node.child("pre_tokenizer").get("add_prefix_space", bool)   # error: gpt2/tokenizer.json: pre_tokenizer.add_prefix_space ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be read exactly: one line naming the file and the field."""


_MISSING = object()
_KINDS = {bool: "true or false", int: "an integer", str: "a string", list: "a list", dict: "an object"}


@dataclass(frozen=True)
class Node:
    value: Any
    file: str
    path: str  # "pre_tokenizer.pretokenizers[1]": where ``value`` sits in the file

    @classmethod
    def root(cls, value: Any, file: str) -> Node:
        if not isinstance(value, dict):
            raise TokenizerError(f"{file}: the top level must be a JSON object")
        return cls(value, file, "")

    def where(self, key: str | int | None = None) -> str:
        """``file: path.key`` for messages."""
        path = self.path
        if isinstance(key, int):
            path += f"[{key}]"
        elif key is not None:
            path += f".{key}" if path else key
        return f"{self.file}: {path}" if path else self.file

    def error(self, message: str, key: str | int | None = None) -> TokenizerError:
        return TokenizerError(f"{self.where(key)} {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        """``value[key]`` of ``kind``; ``default`` when absent or null (required when no default)."""
        if not isinstance(self.value, dict):
            raise self.error("must be a JSON object")
        value = self.value.get(key)
        if value is None:
            if default is _MISSING:
                raise self.error("is missing", key)
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # JSON true/false are Python bools, which are also ints: an integer field must not take them.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join(_KINDS.get(k, k.__name__) for k in kinds)
            raise self.error(f"must be {wanted}, got {value!r}"[:200], key)
        return value

    def child(self, key: str | int) -> Node:
        value = self.value[key] if isinstance(key, int) else self.value.get(key)
        path = f"{self.path}[{key}]" if isinstance(key, int) else (f"{self.path}.{key}" if self.path else key)
        return Node(value, self.file, path)

    def items(self, key: str) -> list[Node]:
        """The nodes of the list ``value[key]``."""
        self.get(key, list)
        lst = self.child(key)
        return [lst.child(i) for i in range(len(lst.value))]

    def type_of(self, supported: tuple[str, ...]) -> str:
        """The object's ``type``, one of ``supported``; else one line:
        ``file: path type "X" is not supported (supported: ...)``."""
        if not isinstance(self.value, dict):
            raise TokenizerError(f"{self.where()} must be a JSON object")
        kind = self.value.get("type")
        if kind not in supported:
            raise TokenizerError(f'{self.where()} type "{kind}" is not supported '
                                 f"(supported: {', '.join(supported)})")
        return kind
