"""Whitespace as Jinja2 renders it with trim_blocks and lstrip_blocks on (transformers' environment), each expected
text derived from the Jinja2 docs' "Whitespace Control" section: trim_blocks removes the first newline after a
block or comment tag, lstrip_blocks the spaces and tabs before a block or comment tag that starts its line,
``+`` turns either off for one tag and ``-`` strips all whitespace on its side; one trailing newline of the source
is dropped (keep_trailing_newline=False)."""

from __future__ import annotations

import pytest

from runtime.tokenizer.chat import ChatTemplate
from runtime.tokenizer.chat.lexer import tokenize


def render(source: str, **context) -> str:
    return ChatTemplate(source).render(context.pop("messages", []), **context)


@pytest.mark.parametrize("source, expected", [
    # The Jinja2 docs' lstrip_blocks + trim_blocks example.
    ("<div>\n    {% if True %}\n        yay\n    {% endif %}\n</div>", "<div>\n        yay\n</div>"),
    # trim_blocks: one newline after %} goes, a second stays; }} keeps its newline.
    ("{% if true %}\nyes\n{% endif %}\nafter", "yes\nafter"),
    ("{% if true %}\n\nyes{% endif %}", "\nyes"),
    ("{{ 'a' }}\nb", "a\nb"),
    ("{# a comment #}\nb", "b"),
    # lstrip_blocks: only when nothing but spaces / tabs precede the tag on its line.
    ("  \t{% if true %}x{% endif %}", "x"),
    ("a  {% if true %}b{% endif %}", "a  b"),
    ("  {{ 'x' }}", "  x"),
    ("  {# c #}\nx", "x"),
    ("{{ 'a' }}  {% if true %}b{% endif %}", "a  b"),
    ("{% if true %}\n  {% if true %}x{% endif %}{% endif %}", "x"),
    ("line\n   {% if true %}x{% endif %}", "line\nx"),
    # + keeps what lstrip_blocks / trim_blocks would remove.
    ("  {%+ if true %}x{% endif %}", "  x"),
    ("{% if true +%}\nx{% endif %}", "\nx"),
    # - removes every whitespace character on its side, newlines included.
    ("a \n\n  {%- if true %}b{% endif %}", "ab"),
    ("{% if true -%}  \n\n b{% endif %}", "b"),
    ("a  {{- 'b' -}}  \n c", "abc"),
    ("a {#- note -#}\n\n b", "ab"),
    # Comments and raw blocks.
    ("a {# note #} b", "a  b"),
    ("{% raw %}{{ not evaluated }} {% if %}{% endraw %}", "{{ not evaluated }} {% if %}"),
    ("{% raw -%}\n  x  {%- endraw %}", "x"),
    # One trailing newline of the source is dropped, not two; line breaks become \n.
    ("x\n", "x"),
    ("x\n\n", "x\n"),
    ("a\r\nb\rc", "a\nb\nc"),
])
def test_whitespace_control(source, expected):
    assert render(source) == expected


def test_a_for_loop_template_in_the_usual_layout():
    source = ("{%- for m in messages %}\n"
              "    {%- if m.role == 'user' %}\n"
              "        {{- '[U] ' + m.content + '\\n' }}\n"
              "    {%- else %}\n"
              "        {{- '[A] ' + m.content + '\\n' }}\n"
              "    {%- endif %}\n"
              "{%- endfor %}\n")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render(source, messages=messages) == "[U] hi\n[A] yo\n"


def test_a_block_on_its_own_line_leaves_no_blank_line():
    source = "Hello\n{% for i in range(2) %}\n  item {{ i }}\n{% endfor %}\nBye"
    assert render(source) == "Hello\n  item 0\n  item 1\nBye"


@pytest.mark.parametrize("source, expected", [
    (r"{{ 'a\nb' }}", "a\nb"),
    (r"{{ 'tab\there' }}", "tab\there"),
    (r'''{{ "it's" }}{{ 'say "hi"' }}{{ 'it\'s' }}''', "it's" + 'say "hi"' + "it's"),
    (r"{{ 'caf\u00e9' }}", "café"),
    ("{{ 'café 你好' }}", "café 你好"),
    (r"{{ 'back\\slash' }}", "back\\slash"),
    (r"{{ '\d+' }}", "\\d+"),  # an unknown escape is kept
])
def test_string_literals_use_python_escapes(source, expected):
    assert render(source) == expected


def test_tokens_carry_their_lines():
    tokens = tokenize("a\n{% if x %}\n{{ y\n + z }}{% endif %}")
    assert [(t.kind, t.value, t.line) for t in tokens if t.kind in ("name", "+", "data")] == [
        ("data", "a\n", 1), ("name", "if", 2), ("name", "x", 2), ("name", "y", 3), ("+", None, 4),
        ("name", "z", 4), ("name", "endif", 4)]


def test_an_end_delimiter_inside_brackets_is_a_closing_brace():
    assert render("{{ {'a': {'b': 1}}}}") == "{'a': {'b': 1}}"
