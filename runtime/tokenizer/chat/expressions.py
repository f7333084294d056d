"""Expressions: tokens -> expression nodes, with Jinja2's grammar and precedence (parser.py), lowest first:

    a if c else b  <  or  <  and  <  not  <  comparisons, in, not in  <  + -  <  ~  <  * / // %  <  **
    <  unary - +  <  postfix (.attr, [key], [a:b:c], call)  <  filters (x | f) and tests (x is t)

so ``'a' + x | trim`` trims only ``x``, ``-x | abs`` is ``abs(-x)`` and ``not x is defined`` is ``not (x is defined)``.
"""

from __future__ import annotations

from runtime.tokenizer.chat import nodes as n
from runtime.tokenizer.chat.stream import TokenStream, describe

COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")
CONSTANTS = {"true": True, "True": True, "false": False, "False": False, "none": None, "None": None}
_PRIMARY_STARTS = ("name", "string", "integer", "float", "(", "[", "{")


class ExpressionParser:
    def __init__(self, stream: TokenStream):
        self.stream = stream

    def tuple(self, *, with_condexpr: bool = True, end_names: tuple[str, ...] = (), parenthesized: bool = False,
              simple: bool = False) -> n.Node:
        """``a, b, c`` as a tuple (Jinja2's parse_tuple); one expression without a comma is itself.
        ``simple``: names and literals only (assignment targets), ``ns.attr`` allowed."""
        s = self.stream
        line, items, is_tuple = s.current.line, [], False
        while True:
            if items:
                s.expect(",")
            if s.current.kind in ("variable_end", "block_end", ")") or s.at_name(*end_names):
                break
            items.append(self.primary(namespace_ref=True) if simple else self.expression(with_condexpr=with_condexpr))
            if not s.at(","):
                break
            is_tuple = True
        if not is_tuple:
            if items:
                return items[0]
            if not parenthesized:
                raise s.fail(f"expected an expression, got {describe(s.current)}")
        return n.TupleLiteral(line, items)

    def expression(self, *, with_condexpr: bool = True) -> n.Node:
        return self.condexpr() if with_condexpr else self.or_()

    def condexpr(self) -> n.Node:
        expr = self.or_()
        while self.stream.skip_if("name", "if"):
            test = self.or_()
            otherwise = self.condexpr() if self.stream.skip_if("name", "else") else None
            expr = n.CondExpr(expr.line, test, expr, otherwise)
        return expr

    def or_(self) -> n.Node:
        left = self.and_()
        while self.stream.skip_if("name", "or"):
            left = n.Binary(left.line, "or", left, self.and_())
        return left

    def and_(self) -> n.Node:
        left = self.not_()
        while self.stream.skip_if("name", "and"):
            left = n.Binary(left.line, "and", left, self.not_())
        return left

    def not_(self) -> n.Node:
        if self.stream.at("name", "not"):
            line = self.stream.next().line
            return n.Unary(line, "not", self.not_())
        return self.compare()

    def compare(self) -> n.Node:
        s = self.stream
        first, ops = self.math1(), []
        while True:
            if s.current.kind in COMPARISONS:
                ops.append((s.next().kind, self.math1()))
            elif s.skip_if("name", "in"):
                ops.append(("in", self.math1()))
            elif s.at("name", "not") and s.look().kind == "name" and s.look().value == "in":
                s.next(), s.next()
                ops.append(("not in", self.math1()))
            else:
                break
        return n.Compare(first.line, first, ops) if ops else first

    def math1(self) -> n.Node:
        left = self.concat()
        while self.stream.current.kind in ("+", "-"):
            op = self.stream.next().kind
            left = n.Binary(left.line, op, left, self.concat())
        return left

    def concat(self) -> n.Node:
        items = [self.math2()]
        while self.stream.skip_if("~"):
            items.append(self.math2())
        return n.Concat(items[0].line, items) if len(items) > 1 else items[0]

    def math2(self) -> n.Node:
        left = self.pow()
        while self.stream.current.kind in ("*", "/", "//", "%"):
            op = self.stream.next().kind
            left = n.Binary(left.line, op, left, self.pow())
        return left

    def pow(self) -> n.Node:
        left = self.unary()
        while self.stream.skip_if("**"):
            left = n.Binary(left.line, "**", left, self.unary())
        return left

    def unary(self, with_filter: bool = True) -> n.Node:
        s = self.stream
        if s.current.kind in ("-", "+"):
            token = s.next()
            node: n.Node = n.Unary(token.line, token.kind, self.unary(with_filter=False))
        else:
            node = self.primary()
        node = self.postfix(node)
        return self.filters_and_tests(node) if with_filter else node

    def primary(self, *, namespace_ref: bool = False) -> n.Node:
        s = self.stream
        token = s.current
        if token.kind == "name":
            s.next()
            if token.value in CONSTANTS:
                return n.Const(token.line, CONSTANTS[token.value])
            if namespace_ref and s.skip_if("."):
                return n.NamespaceRef(token.line, token.value, s.expect("name").value)
            return n.Name(token.line, token.value)
        if token.kind == "string":
            parts = []
            while s.at("string"):  # adjacent literals join, as in Python
                parts.append(s.next().value)
            return n.Const(token.line, "".join(parts))
        if token.kind in ("integer", "float"):
            return n.Const(s.next().line, token.value)
        if token.kind == "(":
            s.next()
            node = self.tuple(parenthesized=True)
            s.expect(")")
            return node
        if token.kind == "[":
            return n.ListLiteral(token.line, self._sequence("[", "]", self.expression))
        if token.kind == "{":
            return n.DictLiteral(token.line, self._sequence("{", "}", self._pair))
        raise s.fail(f"unexpected {describe(token)}")

    def _pair(self) -> tuple[n.Node, n.Node]:
        key = self.expression()
        self.stream.expect(":")
        return key, self.expression()

    def _sequence(self, opening: str, closing: str, item):
        s, items = self.stream, []
        s.expect(opening)
        while not s.at(closing):
            if items:
                s.expect(",")
                if s.at(closing):  # a trailing comma
                    break
            items.append(item())
        s.expect(closing)
        return items

    def postfix(self, node: n.Node) -> n.Node:
        s = self.stream
        while True:
            if s.at("."):
                line = s.next().line
                token = s.next()
                if token.kind == "name":
                    node = n.Getattr(line, node, token.value)
                elif token.kind == "integer":  # x.0 is x[0]
                    node = n.Getitem(line, node, n.Const(token.line, token.value))
                else:
                    raise s.fail(f"expected a name or number after '.', got {describe(token)}", token.line)
            elif s.at("["):
                line = s.next().line
                keys = []
                while not s.at("]"):
                    if keys:
                        s.expect(",")
                    keys.append(self._subscript())
                s.expect("]")
                node = n.Getitem(line, node, keys[0] if len(keys) == 1 else n.TupleLiteral(line, keys))
            elif s.at("("):
                node = n.Call(s.current.line, node, self.arguments())
            else:
                return node

    def _subscript(self) -> n.Node:
        """``key`` or a slice ``a:b:c`` with any part left out."""
        s = self.stream
        line = s.current.line
        start = None if s.at(":") else self.expression()
        if not s.skip_if(":"):
            return start
        stop = None if s.current.kind in (":", "]", ",") else self.expression()
        step = None
        if s.skip_if(":") and s.current.kind not in ("]", ","):
            step = self.expression()
        return n.Slice(line, start, stop, step)

    def filters_and_tests(self, node: n.Node) -> n.Node:
        s = self.stream
        while True:
            if s.at("|"):
                s.next()
                node = self.filter(node)
            elif s.at("name", "is"):
                node = self.test(node)
            elif s.at("("):
                node = n.Call(s.current.line, node, self.arguments())
            else:
                return node

    def filter(self, value: n.Node | None) -> n.Filter:
        """One filter after its ``|``: ``name`` or ``name(args)``."""
        token = self.stream.expect("name")
        name = self._dotted(token.value)
        arguments = self.arguments() if self.stream.at("(") else n.Arguments(token.line)
        return n.Filter(token.line, value, name, arguments)

    def test(self, value: n.Node) -> n.Node:
        s = self.stream
        line = s.next().line  # "is"
        negated = s.skip_if("name", "not")
        name = self._dotted(s.expect("name").value)
        if s.at("("):
            arguments = self.arguments()
        elif s.current.kind in _PRIMARY_STARTS and not s.at_name("else", "or", "and"):
            if s.at_name("is"):
                raise s.fail("tests cannot be chained with 'is'")
            arguments = n.Arguments(line, [self.postfix(self.primary())])  # ``x is divisibleby 3``
        else:
            arguments = n.Arguments(line)
        node: n.Node = n.Test(line, value, name, arguments)
        return n.Unary(line, "not", node) if negated else node

    def _dotted(self, name: str) -> str:
        while self.stream.skip_if("."):
            name += "." + self.stream.expect("name").value
        return name

    def arguments(self) -> n.Arguments:
        """``( a, b, key=value, *rest, **more )``: positional arguments before keyword ones, as in Python."""
        s = self.stream
        call = n.Arguments(s.expect("(").line)
        while not s.at(")"):
            if call.args or call.kwargs or call.star_args or call.star_kwargs:
                s.expect(",")
                if s.at(")"):
                    break
            if s.skip_if("*"):
                call.star_args = self.expression()
            elif s.skip_if("**"):
                call.star_kwargs = self.expression()
            elif s.at("name") and s.look().kind == "=":
                key = s.next().value
                s.next()
                call.kwargs.append((key, self.expression()))
            else:
                if call.kwargs or call.star_args or call.star_kwargs:
                    raise s.fail("a positional argument follows a keyword argument")
                call.args.append(self.expression())
        s.expect(")")
        return call
