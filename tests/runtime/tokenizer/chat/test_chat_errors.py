"""What this engine does not support, and malformed templates: one ChatTemplateError (a ValueError), one line,
naming the template line and the construct, raised when the template is read (not at its first render)."""

from __future__ import annotations

import pytest

from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError


@pytest.mark.parametrize("source, message", [
    ("a\nb\n{% include 'other.jinja' %}", "chat template line 3: unsupported tag 'include'"),
    ("{% extends 'base.jinja' %}", "chat template line 1: unsupported tag 'extends'"),
    ("{% macro m() %}{{ caller() }}{% endmacro %}\n{% call m() %}x{% endcall %}", "chat template line 2: unsupported tag 'call'"),
    ("{% block body %}x{% endblock %}", "chat template line 1: unsupported tag 'block'"),
    ("{% import 'x' as y %}", "chat template line 1: unsupported tag 'import'"),
    ("{% with a = 1 %}{{ a }}{% endwith %}", "chat template line 1: unsupported tag 'with'"),
    ("{% do xs.append(1) %}", "chat template line 1: unsupported tag 'do'"),
    ("{% for x in xs recursive %}{{ loop(x) }}{% endfor %}", "chat template line 1: unsupported recursive for loop"),
    ("\n{{ x | wordwrap(10) }}", "chat template line 2: unsupported filter 'wordwrap'"),
    ("{% if x is escaped %}{% endif %}", "chat template line 1: unsupported test 'escaped'"),
    ("{% set y | urlize %}x{% endset %}", "chat template line 1: unsupported filter 'urlize'"),
])
def test_unsupported_constructs_are_one_line_errors(source, message):
    with pytest.raises(ChatTemplateError) as error:
        ChatTemplate(source)
    assert str(error.value) == message
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("source, message", [
    ("{% for x in xs %}\n{{ x }}", r"^chat template line 2: unexpected end of template, expected 'endfor' or 'else'$"),
    ("{% if x %}\n{% endfor %}", r"^chat template line 2: unexpected tag 'endfor'$"),
    ("{% endif %}", r"^chat template line 1: unexpected tag 'endif'$"),
    ("{{ x ", r"^chat template line 1: unexpected end of template: \{\{ is never closed$"),
    ("{% if x", r"^chat template line 1: unexpected end of template: \{% is never closed$"),
    ("{# note", r"^chat template line 1: missing end of comment tag '#\}'$"),
    ("{% raw %}x", r"^chat template line 1: missing \{% endraw %\} for \{% raw %\}$"),
    ("{{ (1 }}", r"^chat template line 1: unexpected '\}', expected '\)'$"),
    ("{{ 1 ) }}", r"^chat template line 1: unexpected '\)'$"),
    ("{{ }}", r"^chat template line 1: expected an expression, got '\}\}'$"),
    ("{{ 1 + }}", r"^chat template line 1: unexpected '\}\}'$"),
    ("{{ x $ y }}", r"^chat template line 1: unexpected character '\$'$"),
    ("{% break %}", r"^chat template line 1: 'break' outside a for loop$"),
    ("{% set 1 = x %}", r"^chat template line 1: cannot assign to Const$"),
    ("{% macro f(a=1, b) %}{% endmacro %}", r"a parameter without a default follows one with a default$"),
    ("{{ f(a=1, 2) }}", r"^chat template line 1: a positional argument follows a keyword argument$"),
    ("{{ x is defined is defined }}", r"^chat template line 1: tests cannot be chained with 'is'$"),
    ("{{ 'a\\N{nonsense}' }}", r"^chat template line 1: bad escape in string literal"),
    ("{% 'if' %}", r"^chat template line 1: expected a tag name, got 'if'$"),
])
def test_malformed_templates_name_the_line(source, message):
    with pytest.raises(ChatTemplateError, match=message) as error:
        ChatTemplate(source)
    assert "\n" not in str(error.value)
