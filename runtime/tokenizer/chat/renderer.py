"""Statement nodes -> Python closures ``run(scope, out)`` that append the rendered text to ``out``.

Scopes as Jinja2 has them: ``if`` shares its scope; every for-loop iteration, macro call, block ``set``,
``filter`` and ``generation`` body gets a fresh child scope, so a ``{% set %}`` inside a loop does not reach the
next iteration or the code after the loop (templates carry values out through ``namespace()``). An error raised
while running a statement becomes a ChatTemplateError naming that statement's line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.tokenizer.chat import nodes as n
from runtime.tokenizer.chat.errors import ChatTemplateError, with_line
from runtime.tokenizer.chat.evaluator import Scope, compile_expression, compile_filter, compile_target
from runtime.tokenizer.chat.values import LoopContext, Undefined

Run = Callable[[Scope, list], None]


class _LoopControl(Exception):
    pass


class _Break(_LoopControl):
    pass


class _Continue(_LoopControl):
    pass


_PASS_THROUGH = (ChatTemplateError, _LoopControl)


@dataclass
class RenderState:
    """What one render shares: the top-level output and, when asked, the spans of ``{% generation %}`` bodies."""
    out: list[str]
    track_generation: bool = False
    generation_spans: list[tuple[int, int]] = field(default_factory=list)


def compile_body(body: list[n.Node]) -> Run:
    runs = [_STATEMENTS[type(node)](node) for node in body]
    if len(runs) == 1:
        return runs[0]

    def run(scope: Scope, out: list) -> None:
        for statement in runs:
            statement(scope, out)
    return run


def _data(node: n.Data) -> Run:
    text = node.text
    return lambda scope, out: out.append(text)


def _print(node: n.Print) -> Run:
    expr, line = compile_expression(node.expr), node.line

    def run(scope: Scope, out: list) -> None:
        try:
            out.append(str(expr(scope)))
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise with_line(e, line) from e
    return run


def _if(node: n.If) -> Run:
    branches = [(compile_expression(test), compile_body(body), test.line) for test, body in node.branches]
    otherwise = compile_body(node.otherwise)

    def run(scope: Scope, out: list) -> None:
        for test, body, line in branches:
            try:
                chosen = bool(test(scope))
            except _PASS_THROUGH:
                raise
            except Exception as e:
                raise with_line(e, line) from e
            if chosen:
                return body(scope, out)
        otherwise(scope, out)
    return run


def _for(node: n.For) -> Run:
    iterable, assign = compile_expression(node.iterable), compile_target(node.target)
    body, otherwise, line = compile_body(node.body), compile_body(node.otherwise), node.line
    test = compile_expression(node.test) if node.test is not None else None

    def passes(scope: Scope, item: Any) -> bool:
        inner = scope.child()
        assign(inner, item)
        return bool(test(inner))

    def run(scope: Scope, out: list) -> None:
        try:
            items = list(iterable(scope))  # an Undefined iterates as empty
            if test is not None:
                items = [item for item in items if passes(scope, item)]
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise with_line(e, line) from e
        if not items:
            return otherwise(scope.child(), out)
        loop = LoopContext(items)
        for index, item in enumerate(items):
            loop.index0 = index
            inner = scope.child({"loop": loop})
            try:
                assign(inner, item)
            except _PASS_THROUGH:
                raise
            except Exception as e:
                raise with_line(e, line) from e
            try:
                body(inner, out)
            except _Break:
                break
            except _Continue:
                continue
    return run


def _assign(node: n.Assign) -> Run:
    expr, assign, line = compile_expression(node.expr), compile_target(node.target), node.line

    def run(scope: Scope, out: list) -> None:
        try:
            assign(scope, expr(scope))
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise with_line(e, line) from e
    return run


def _capture(body: Run, scope: Scope) -> str:
    buffer: list[str] = []
    body(scope.child(), buffer)
    return "".join(buffer)


def _assign_block(node: n.AssignBlock) -> Run:
    body, assign, line = compile_body(node.body), compile_target(node.target), node.line
    apply = compile_filter(node.filter) if node.filter is not None else None

    def run(scope: Scope, out: list) -> None:
        text = _capture(body, scope)
        try:
            assign(scope, apply(scope, text) if apply is not None else text)
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise with_line(e, line) from e
    return run


def _filter_block(node: n.FilterBlock) -> Run:
    body, apply, line = compile_body(node.body), compile_filter(node.filter), node.line

    def run(scope: Scope, out: list) -> None:
        text = _capture(body, scope)
        try:
            out.append(str(apply(scope, text)))
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise with_line(e, line) from e
    return run


def _generation(node: n.Generation) -> Run:
    body, line = compile_body(node.body), node.line

    def run(scope: Scope, out: list) -> None:
        text = _capture(body, scope)
        state: RenderState = scope.state
        if state.track_generation:
            if out is not state.out:  # transformers counts only top-level output, so a nested block has no span
                raise ChatTemplateError("a {% generation %} block inside a macro, set or filter block has no "
                                        "span in the output", line=line)
            start = sum(map(len, out))
            state.generation_spans.append((start, start + len(text)))
        out.append(text)
    return run


class Macro:
    """A ``{% macro %}`` as a callable: its parameters bound (missing ones from their defaults, evaluated at
    the call in the macro's scope, or Undefined), extra positional arguments as ``varargs`` and extra keyword
    arguments as ``kwargs`` when the body uses those names (else a TypeError, as in Jinja2)."""

    def __init__(self, name: str, params: list[str], defaults: dict[str, Callable], *, body: Run, scope: Scope,
                 catch_varargs: bool, catch_kwargs: bool):
        self.name, self.params, self.defaults, self.body, self.scope = name, params, defaults, body, scope
        self.catch_varargs, self.catch_kwargs = catch_varargs, catch_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        if len(args) > len(self.params) and not self.catch_varargs:
            raise TypeError(f"macro {self.name!r} takes not more than {len(self.params)} argument(s)")
        scope = self.scope.child()
        missing = []
        for i, param in enumerate(self.params):
            if i < len(args):
                scope.vars[param] = args[i]
            elif param in kwargs:
                scope.vars[param] = kwargs.pop(param)
            else:
                missing.append(param)
        if kwargs and not self.catch_kwargs:
            raise TypeError(f"macro {self.name!r} takes no keyword argument {next(iter(kwargs))!r}")
        scope.vars.update({"varargs": tuple(args[len(self.params):])} if self.catch_varargs else {})
        scope.vars.update({"kwargs": kwargs} if self.catch_kwargs else {})
        for param in missing:
            default = self.defaults.get(param)
            scope.vars[param] = default(scope) if default is not None else Undefined(
                f"parameter {param!r} was not provided", name=param)
        out: list[str] = []
        self.body(scope, out)
        return "".join(out)

    def __repr__(self) -> str:
        return f"<Macro {self.name!r}>"


def _macro(node: n.Macro) -> Run:
    body, name, params = compile_body(node.body), node.name, node.params
    defaults = dict(zip(params[len(params) - len(node.defaults):], map(compile_expression, node.defaults)))
    used = {m.name for statement in node.body for m in statement.walk() if isinstance(m, n.Name)}

    def run(scope: Scope, out: list) -> None:
        scope.vars[name] = Macro(name, params, defaults, body=body, scope=scope,
                                 catch_varargs="varargs" in used, catch_kwargs="kwargs" in used)
    return run


def _break(node: n.Break) -> Run:
    def run(scope: Scope, out: list) -> None:
        raise _Break
    return run


def _continue(node: n.Continue) -> Run:
    def run(scope: Scope, out: list) -> None:
        raise _Continue
    return run


_STATEMENTS: dict[type, Callable[[Any], Run]] = {
    n.Data: _data, n.Print: _print, n.If: _if, n.For: _for, n.Assign: _assign, n.AssignBlock: _assign_block,
    n.FilterBlock: _filter_block, n.Generation: _generation, n.Macro: _macro, n.Break: _break, n.Continue: _continue,
}
