"""Expression nodes -> Python closures ``f(scope) -> value``, built once per template so a render only calls them.

Operators are Python's, as Jinja2 compiles them (``/`` true division, ``in`` Python's containment, chained
comparisons, ``and`` / ``or`` returning an operand); ``~`` joins ``str`` of each side (an Undefined is "").
Scopes follow Jinja2's: a name is looked up from the innermost scope out to the globals; a miss is Undefined.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from runtime.tokenizer.chat import nodes as n
from runtime.tokenizer.chat.errors import ChatTemplateError, TemplateRuntimeError
from runtime.tokenizer.chat.filters import FILTERS
from runtime.tokenizer.chat.predicates import TESTS
from runtime.tokenizer.chat.values import Namespace, Undefined, call, get_attribute, get_item

Evaluate = Callable[["Scope"], Any]

_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
           "%": operator.mod, "**": operator.pow}
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b}
_UNARY = {"not": operator.not_, "-": operator.neg, "+": operator.pos}


class Scope:
    """One level of variables (a template, a loop iteration, a macro call) over its parent."""

    __slots__ = ("vars", "parent", "state")

    def __init__(self, variables: dict, parent: Scope | None = None, state: Any = None):
        self.vars, self.parent = variables, parent
        self.state = state if state is not None or parent is None else parent.state

    def lookup(self, name: str) -> Any:
        scope = self
        while scope is not None:
            if name in scope.vars:
                return scope.vars[name]
            scope = scope.parent
        return Undefined(name=name)

    def child(self, variables: dict | None = None) -> Scope:
        return Scope({} if variables is None else variables, self, self.state)


def compile_expression(node: n.Node) -> Evaluate:
    compiler = _COMPILERS.get(type(node))
    if compiler is None:
        raise ChatTemplateError(f"{type(node).__name__} cannot be used as a value here", line=node.line)
    return compiler(node)


def _const(node: n.Const) -> Evaluate:
    value = node.value
    return lambda scope: value


def _name(node: n.Name) -> Evaluate:
    name = node.name
    return lambda scope: scope.lookup(name)


def _tuple(node: n.TupleLiteral) -> Evaluate:
    items = [compile_expression(item) for item in node.items]
    return lambda scope: tuple([item(scope) for item in items])


def _list(node: n.ListLiteral) -> Evaluate:
    items = [compile_expression(item) for item in node.items]
    return lambda scope: [item(scope) for item in items]


def _dict(node: n.DictLiteral) -> Evaluate:
    pairs = [(compile_expression(k), compile_expression(v)) for k, v in node.pairs]
    return lambda scope: {k(scope): v(scope) for k, v in pairs}


def _getattr(node: n.Getattr) -> Evaluate:
    obj, attr = compile_expression(node.obj), node.attr
    return lambda scope: get_attribute(obj(scope), attr)


def _getitem(node: n.Getitem) -> Evaluate:
    obj = compile_expression(node.obj)
    if isinstance(node.key, n.Slice):
        parts = [compile_expression(p) if p is not None else None for p in (node.key.start, node.key.stop, node.key.step)]
        start, stop, step = (p or (lambda scope: None) for p in parts)
        return lambda scope: get_item(obj(scope), slice(start(scope), stop(scope), step(scope)))
    key = compile_expression(node.key)
    return lambda scope: get_item(obj(scope), key(scope))


def compile_arguments(arguments: n.Arguments) -> Callable[[Scope], tuple[list, dict]]:
    """The positional list and keyword dict a call passes, ``*rest`` and ``**more`` spread in."""
    args = [compile_expression(a) for a in arguments.args]
    kwargs = [(key, compile_expression(v)) for key, v in arguments.kwargs]
    star_args = compile_expression(arguments.star_args) if arguments.star_args is not None else None
    star_kwargs = compile_expression(arguments.star_kwargs) if arguments.star_kwargs is not None else None

    def evaluate(scope: Scope) -> tuple[list, dict]:
        values = [a(scope) for a in args]
        keywords = {key: v(scope) for key, v in kwargs}
        if star_args is not None:
            values.extend(star_args(scope))
        if star_kwargs is not None:
            keywords.update(star_kwargs(scope))
        return values, keywords
    return evaluate


def _call(node: n.Call) -> Evaluate:
    func, arguments = compile_expression(node.func), compile_arguments(node.arguments)

    def evaluate(scope: Scope) -> Any:
        target = func(scope)
        args, kwargs = arguments(scope)
        return call(target, args, kwargs)
    return evaluate


def compile_filter(node: n.Filter) -> Callable[[Scope, Any], Any]:
    """``f(scope, x)``: the filter chain applied to ``x`` where its innermost value is missing (block filters)."""
    apply, arguments = FILTERS[node.name], compile_arguments(node.arguments)
    inner = compile_filter(node.value) if node.value is not None else None  # the parser chains only filters here

    def evaluate(scope: Scope, value: Any) -> Any:
        args, kwargs = arguments(scope)
        return apply(value if inner is None else inner(scope, value), *args, **kwargs)
    return evaluate


def _filter(node: n.Filter) -> Evaluate:
    if node.value is None:
        raise ChatTemplateError(f"filter {node.name!r} has no value", line=node.line)
    value, apply, arguments = compile_expression(node.value), FILTERS[node.name], compile_arguments(node.arguments)

    def evaluate(scope: Scope) -> Any:
        args, kwargs = arguments(scope)
        return apply(value(scope), *args, **kwargs)
    return evaluate


def _test(node: n.Test) -> Evaluate:
    value, test, arguments = compile_expression(node.value), TESTS[node.name], compile_arguments(node.arguments)

    def evaluate(scope: Scope) -> Any:
        args, kwargs = arguments(scope)
        return test(value(scope), *args, **kwargs)
    return evaluate


def _unary(node: n.Unary) -> Evaluate:
    operand, op = compile_expression(node.operand), _UNARY[node.op]
    return lambda scope: op(operand(scope))


def _binary(node: n.Binary) -> Evaluate:
    left, right = compile_expression(node.left), compile_expression(node.right)
    if node.op == "and":
        return lambda scope: left(scope) and right(scope)
    if node.op == "or":
        return lambda scope: left(scope) or right(scope)
    op = _BINARY[node.op]
    return lambda scope: op(left(scope), right(scope))


def _concat(node: n.Concat) -> Evaluate:
    items = [compile_expression(item) for item in node.items]
    return lambda scope: "".join([str(item(scope)) for item in items])


def _compare(node: n.Compare) -> Evaluate:
    first = compile_expression(node.first)
    ops = [(_COMPARE[op], compile_expression(expr)) for op, expr in node.ops]
    if len(ops) == 1:
        (op, right), = ops
        return lambda scope: op(first(scope), right(scope))

    def evaluate(scope: Scope) -> Any:  # a < b < c: each pair, stopping at the first false one (Python's rule)
        value = first(scope)
        for op, expr in ops:
            other = expr(scope)
            result = op(value, other)
            if not result:
                return result
            value = other
        return result
    return evaluate


def _condexpr(node: n.CondExpr) -> Evaluate:
    test, then = compile_expression(node.test), compile_expression(node.then)
    if node.otherwise is not None:
        otherwise = compile_expression(node.otherwise)
    else:
        hint = f"the inline if-expression on line {node.line} evaluated to false and no else section was defined."
        otherwise = lambda scope: Undefined(hint)  # noqa: E731
    return lambda scope: then(scope) if test(scope) else otherwise(scope)


_COMPILERS: dict[type, Callable[[Any], Evaluate]] = {
    n.Const: _const, n.Name: _name, n.TupleLiteral: _tuple, n.ListLiteral: _list, n.DictLiteral: _dict,
    n.Getattr: _getattr, n.Getitem: _getitem, n.Call: _call, n.Filter: _filter, n.Test: _test, n.Unary: _unary,
    n.Binary: _binary, n.Concat: _concat, n.Compare: _compare, n.CondExpr: _condexpr,
}


def compile_target(node: n.Node) -> Callable[[Scope, Any], None]:
    """Assignment to ``name``, ``a, (b, c)`` (unpacking as Python does) or ``ns.attr`` in the given scope."""
    if isinstance(node, n.Name):
        name = node.name

        def assign(scope: Scope, value: Any) -> None:
            scope.vars[name] = value
        return assign
    if isinstance(node, n.NamespaceRef):
        name, attr = node.name, node.attr

        def assign_attribute(scope: Scope, value: Any) -> None:
            namespace = scope.lookup(name)
            if not isinstance(namespace, Namespace):
                raise TemplateRuntimeError(f"cannot assign attribute {attr!r} on {name!r}: it is not a namespace()")
            namespace.attrs[attr] = value
        return assign_attribute
    parts = [compile_target(item) for item in node.items]

    def unpack(scope: Scope, value: Any) -> None:
        values = list(value)
        if len(values) != len(parts):
            raise TemplateRuntimeError(f"cannot unpack {len(values)} values into {len(parts)} names")
        for part, item in zip(parts, values):
            part(scope, item)
    return unpack
