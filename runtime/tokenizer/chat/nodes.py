"""The parsed template: expression and statement nodes (the subset of Jinja2's nodes.py chat templates use).

Every node keeps the template line it starts on, for error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterator


@dataclass(slots=True)
class Node:
    line: int

    def children(self) -> Iterator[Node]:
        for f in fields(self):
            value = getattr(self, f.name)
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, Node):
                    yield item
                elif isinstance(item, tuple):  # (test, body) branches, (op, expr) comparisons, (key, value) pairs
                    for part in item:
                        if isinstance(part, Node):
                            yield part
                        elif isinstance(part, list):
                            yield from (n for n in part if isinstance(n, Node))

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children():
            yield from child.walk()


# ---- expressions ----

@dataclass(slots=True)
class Const(Node):
    value: object


@dataclass(slots=True)
class Name(Node):
    name: str


@dataclass(slots=True)
class NamespaceRef(Node):
    """``ns.attr`` as the target of ``{% set ns.attr = ... %}``."""
    name: str
    attr: str


@dataclass(slots=True)
class TupleLiteral(Node):
    items: list[Node]


@dataclass(slots=True)
class ListLiteral(Node):
    items: list[Node]


@dataclass(slots=True)
class DictLiteral(Node):
    pairs: list[tuple[Node, Node]]


@dataclass(slots=True)
class Getattr(Node):
    obj: Node
    attr: str


@dataclass(slots=True)
class Getitem(Node):
    obj: Node
    key: Node


@dataclass(slots=True)
class Slice(Node):
    start: Node | None
    stop: Node | None
    step: Node | None


@dataclass(slots=True)
class Arguments(Node):
    """A call's arguments: ``f(a, b, k=v, *rest, **more)``."""
    args: list[Node] = field(default_factory=list)
    kwargs: list[tuple[str, Node]] = field(default_factory=list)
    star_args: Node | None = None
    star_kwargs: Node | None = None


@dataclass(slots=True)
class Call(Node):
    func: Node
    arguments: Arguments


@dataclass(slots=True)
class Filter(Node):
    value: Node | None  # None in ``{% filter name %}`` and ``{% set x | name %}``: applied to the body
    name: str
    arguments: Arguments


@dataclass(slots=True)
class Test(Node):
    value: Node
    name: str
    arguments: Arguments


@dataclass(slots=True)
class Unary(Node):
    op: str  # "not", "-", "+"
    operand: Node


@dataclass(slots=True)
class Binary(Node):
    op: str  # "+", "-", "*", "/", "//", "%", "**", "and", "or"
    left: Node
    right: Node


@dataclass(slots=True)
class Concat(Node):
    items: list[Node]


@dataclass(slots=True)
class Compare(Node):
    first: Node
    ops: list[tuple[str, Node]]  # "==", "!=", "<", "<=", ">", ">=", "in", "not in"


@dataclass(slots=True)
class CondExpr(Node):
    test: Node
    then: Node
    otherwise: Node | None


# ---- statements ----

@dataclass(slots=True)
class Data(Node):
    text: str


@dataclass(slots=True)
class Print(Node):
    expr: Node


@dataclass(slots=True)
class If(Node):
    branches: list[tuple[Node, list[Node]]]  # (test, body) for if and each elif
    otherwise: list[Node]


@dataclass(slots=True)
class For(Node):
    target: Node
    iterable: Node
    body: list[Node]
    otherwise: list[Node]
    test: Node | None


@dataclass(slots=True)
class Assign(Node):
    target: Node
    expr: Node


@dataclass(slots=True)
class AssignBlock(Node):
    target: Node
    filter: Filter | None
    body: list[Node]


@dataclass(slots=True)
class Macro(Node):
    name: str
    params: list[str]
    defaults: list[Node]  # for the last len(defaults) params
    body: list[Node]


@dataclass(slots=True)
class FilterBlock(Node):
    filter: Filter
    body: list[Node]


@dataclass(slots=True)
class Generation(Node):
    """transformers' ``{% generation %}...{% endgeneration %}``: the body, its span recorded as assistant text."""
    body: list[Node]


@dataclass(slots=True)
class Break(Node):
    pass


@dataclass(slots=True)
class Continue(Node):
    pass
