"""Tokens -> the statement tree: data, ``{{ }}``, and the tags chat templates use (Jinja2's parser.py).

Supported tags: if / elif / else, for (tuple targets, an inline ``if`` filter, for-else), set (``=``, tuple
targets, ``ns.attr``, block set with an optional filter), macro, filter, break / continue (transformers enables
loopcontrols), generation (transformers' AssistantTracker), raw and comments (in the lexer). Any other tag, a
filter or test this engine does not have, or a call block is a ChatTemplateError naming the line.
"""

from __future__ import annotations

from runtime.tokenizer.chat import nodes as n
from runtime.tokenizer.chat.errors import ChatTemplateError
from runtime.tokenizer.chat.expressions import ExpressionParser
from runtime.tokenizer.chat.lexer import tokenize
from runtime.tokenizer.chat.stream import TokenStream, describe

_END_TAGS = {"endif", "endfor", "endset", "endmacro", "endfilter", "endgeneration", "elif", "else"}


def parse(source: str, *, filters: set[str], tests: set[str]) -> list[n.Node]:
    """The template's statements; ``filters`` and ``tests``: the names the evaluator has (others are errors
    here, at parse time, as Jinja2 reports unknown filters when it compiles)."""
    parser = _Parser(TokenStream(tokenize(source)))
    body = parser.statements(end_tags=())
    for node in (node for statement in body for node in statement.walk()):
        if isinstance(node, n.Filter) and node.name not in filters:
            raise ChatTemplateError(f"unsupported filter {node.name!r}", line=node.line)
        if isinstance(node, n.Test) and node.name not in tests:
            raise ChatTemplateError(f"unsupported test {node.name!r}", line=node.line)
    return body


class _Parser:
    def __init__(self, stream: TokenStream):
        self.stream, self.expressions = stream, ExpressionParser(stream)
        self.loops = 0  # break / continue are valid only inside a for body

    def statements(self, end_tags: tuple[str, ...]) -> list[n.Node]:
        """Statements up to one of ``end_tags`` (left as the current token, after its ``{%``) or the end."""
        s, body = self.stream, []
        while True:
            token = s.current
            if token.kind == "eof":
                if end_tags:
                    raise s.fail(f"unexpected end of template, expected {' or '.join(map(repr, end_tags))}")
                return body
            if token.kind == "data":
                body.append(n.Data(token.line, s.next().value))
            elif token.kind == "variable_begin":
                s.next()
                body.append(n.Print(token.line, self.expressions.tuple()))
                s.expect("variable_end")
            else:  # block_begin
                s.next()
                if s.at_name(*end_tags):
                    return body
                body.append(self.statement())
                s.expect("block_end")

    def body(self, *end_tags: str) -> tuple[list[n.Node], str]:
        """A tag's body after its ``%}``; returns it and the end tag that closed it (consumed)."""
        self.stream.expect("block_end")
        body = self.statements(end_tags)
        return body, self.stream.next().value

    def statement(self) -> n.Node:
        s = self.stream
        token = s.current
        if token.kind != "name":
            raise s.fail(f"expected a tag name, got {describe(token)}")
        handler = getattr(self, f"_tag_{token.value}", None)
        if handler is None:
            what = "unexpected" if token.value in _END_TAGS else "unsupported"
            raise s.fail(f"{what} tag {token.value!r}")
        s.next()
        return handler(token.line)

    def _tag_if(self, line: int) -> n.If:
        branches, otherwise = [], []
        while True:
            test = self.expressions.tuple(with_condexpr=False)
            body, end = self.body("elif", "else", "endif")
            branches.append((test, body))
            if end == "else":
                otherwise, _ = self.body("endif")
            if end != "elif":
                return n.If(line, branches, otherwise)

    def _tag_for(self, line: int) -> n.For:
        e = self.expressions
        target = e.tuple(simple=True, end_names=("in",))
        self._check_target(target, namespace_ok=False)
        self.stream.expect("name", "in")
        iterable = e.tuple(with_condexpr=False, end_names=("recursive",))
        test = e.expression() if self.stream.skip_if("name", "if") else None
        if self.stream.at_name("recursive"):
            raise self.stream.fail("unsupported recursive for loop")
        self.loops += 1
        body, end = self.body("endfor", "else")
        self.loops -= 1
        otherwise = self.body("endfor")[0] if end == "else" else []
        return n.For(line, target, iterable, body, otherwise, test)

    def _tag_set(self, line: int) -> n.Node:
        target = self.expressions.tuple(simple=True)
        self._check_target(target, namespace_ok=True)
        if self.stream.skip_if("="):
            return n.Assign(line, target, self.expressions.tuple())
        block_filter = None
        if self.stream.skip_if("|"):
            block_filter = self._filter_chain()
        return n.AssignBlock(line, target, block_filter, self.body("endset")[0])

    def _tag_macro(self, line: int) -> n.Macro:
        s = self.stream
        name = s.expect("name").value
        params, defaults = [], []
        s.expect("(")
        while not s.at(")"):
            if params:
                s.expect(",")
            params.append(s.expect("name").value)
            if s.skip_if("="):
                defaults.append(self.expressions.expression())
            elif defaults:
                raise s.fail(f"macro {name!r}: a parameter without a default follows one with a default")
        s.expect(")")
        loops, self.loops = self.loops, 0  # a macro body is not inside the loop around its definition
        body = self.body("endmacro")[0]
        self.loops = loops
        return n.Macro(line, name, params, defaults, body)

    def _tag_filter(self, line: int) -> n.FilterBlock:
        return n.FilterBlock(line, self._filter_chain(), self.body("endfilter")[0])

    def _tag_generation(self, line: int) -> n.Generation:
        return n.Generation(line, self.body("endgeneration")[0])

    def _tag_break(self, line: int) -> n.Break:
        if not self.loops:
            raise ChatTemplateError("'break' outside a for loop", line=line)
        return n.Break(line)

    def _tag_continue(self, line: int) -> n.Continue:
        if not self.loops:
            raise ChatTemplateError("'continue' outside a for loop", line=line)
        return n.Continue(line)

    def _filter_chain(self) -> n.Filter:
        """``name(args) | name2 ...`` applied to a block's body: the innermost filter has no value."""
        node = self.expressions.filter(None)
        while self.stream.skip_if("|"):
            node = self.expressions.filter(node)
        return node

    def _check_target(self, target: n.Node, *, namespace_ok: bool) -> None:
        items = target.items if isinstance(target, n.TupleLiteral) else [target]
        for item in items:
            if isinstance(item, n.TupleLiteral):
                self._check_target(item, namespace_ok=False)
            elif not (isinstance(item, n.Name) or (namespace_ok and isinstance(item, n.NamespaceRef))):
                raise ChatTemplateError(f"cannot assign to {type(item).__name__}", line=item.line)
