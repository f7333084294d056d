"""Filters and tests as the Jinja2 docs' "List of Builtin Filters" / "List of Builtin Tests" define them, and
``tojson`` as transformers overrides it (json.dumps with ensure_ascii=False: no HTML escaping)."""

from __future__ import annotations

import pytest

from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError


def render(source: str, **context) -> str:
    return ChatTemplate(source).render(context.pop("messages", []), **context)


USERS = [{"name": "ann", "age": 31}, {"name": "Bo", "age": 25}, {"name": "cy"}]
MSGS = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


@pytest.mark.parametrize("source, expected", [
    ("[{{ '  x \n' | trim }}] [{{ 'xxaxx' | trim('x') }}]", "[x] [a]"),
    ("{{ {'b': 'é', 'a': [1, none, true, 1.5]} | tojson }}", '{"b": "é", "a": [1, null, true, 1.5]}'),
    ("{{ {'b': 1, 'a': [2]} | tojson(indent=2, sort_keys=true) }}", '{\n  "a": [\n    2\n  ],\n  "b": 1\n}'),
    ("{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}", '{"a":[1,2]}'),
    ("{{ '<b>&\\'' | tojson }}", "\"<b>&'\""),
    ("{{ [1, 2] | length }} {{ 'abc' | count }} {{ {'a': 1} | length }}", "2 3 1"),
    ("{{ none | default('d') }} [{{ '' | default('d') }}] {{ '' | default('d', true) }} {{ x | d('d') }}", "None [] d d"),
    ("{% for k, v in {'a': 1, 'b': 2} | items %}{{ k }}{{ v }}{% endfor %}{% for k in missing | items %}x{% endfor %}",
     "a1b2"),
    ("{{ [1, 2, 3] | join(', ') }} {{ 'abc' | join('-') }} {{ users | join(',', attribute='name') }}",
     "1, 2, 3 a-b-c ann,Bo,cy"),
    ("{{ 'hello wORLD' | title }} {{ 'hello-there (you)' | title }} {{ 'hELLO there' | capitalize }}",
     "Hello World Hello-There (You) Hello there"),
    ("{{ 'aBc' | upper }} {{ 'AbC' | lower }} {{ 1 | string ~ 'x' }} {{ [1] | string }} {{ none | string }}",
     "ABC abc 1x [1] None"),
    ("{{ 'ab' | list }} {{ {'k': 1} | list }}", "['a', 'b'] ['k']"),
    ("{{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} [{{ [] | first }}] {{ 'xyz' | first }}", "1 3 [] x"),
    ("{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }}", "bbb bba"),
    ("{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ '1A' | int(0, 16) }} {{ 3.9 | int }}",
     "42 4 0 7 26 3"),
    ("{{ '1.5' | float }} {{ 'x' | float }} {{ 2 | float }}", "1.5 0.0 2.0"),
    ("{{ -1.5 | abs }} {{ 2.5 | round }} {{ 3.14159 | round(2) }} {{ 2.1 | round(0, 'ceil') }} {{ 2.9 | round(0, 'floor') }}",
     "1.5 2.0 3.14 3.0 2.0"),
    ("{{ users | map(attribute='name') | join(',') }} {{ ['a', 'b'] | map('upper') | list }}", "ann,Bo,cy ['A', 'B']"),
    ("{{ users | map(attribute='age', default=0) | list }} {{ [[1, 2]] | map('join', '-') | list }}", "[31, 25, 0] ['1-2']"),
    ("{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('odd') | list }} {{ [0, 1, '', 'a'] | select | list }}",
     "[1, 3] [2, 4] [1, 'a']"),
    ("{{ [1, 2, 3] | select('in', [2, 3]) | list }} {{ [1, 2, 3] | select('greaterthan', 1) | list }}", "[2, 3] [2, 3]"),
    ("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join }} "
     "{{ msgs | rejectattr('role', 'eq', 'user') | list | length }} {{ users | selectattr('age') | list | length }}",
     "ac 1 2"),
    ("{{ ['a', 'A', 'b', 'a'] | unique | list }} {{ ['a', 'A', 'b'] | unique(case_sensitive=true) | list }}",
     "['a', 'b'] ['a', 'A', 'b']"),
    ("{{ users[:2] | unique(attribute='age') | map(attribute='name') | list }}", "['ann', 'Bo']"),
    ("{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ ['b', 'a', 'C'] | sort }} "
     "{{ ['b', 'a', 'C'] | sort(case_sensitive=true) }}", "[1, 2, 3] [3, 2, 1] ['a', 'b', 'C'] ['C', 'a', 'b']"),
    ("{{ users[:2] | sort(attribute='age') | map(attribute='name') | join }}", "Boann"),
    ("{{ 'abc' | reverse }} {{ [1, 2, 3] | reverse | list }}", "cba [3, 2, 1]"),
    ("{{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, first=true) }}|{{ 'a\n\nb' | indent('> ', blank=true) }}",
     "a\n  b\n\n  c|  a\n  b|a\n> \n> b"),
    ("{{ '<a href=\"x\">&\\'' | e }} {{ '<b>' | escape | escape }} {{ 1 | escape }}",
     "&lt;a href=&#34;x&#34;&gt;&amp;&#39; &lt;b&gt; 1"),
    ("{{ '<b>' | safe }} {{ ('<b>' | safe) + '<i>' }} {{ ('<b>' | safe) ~ '<i>' }}", "<b> <b>&lt;i&gt; <b><i>"),
    ("{{ {'b': 1, 'A': 2} | dictsort }} {{ {'a': 2, 'b': 1} | dictsort(by='value') }}",
     "[('A', 2), ('b', 1)] [('b', 1), ('a', 2)]"),
    ("{{ [1, 2, 3] | sum }} {{ users[:2] | sum(attribute='age') }} {{ [3, 1] | min }} {{ ['a', 'B'] | max }}",
     "6 56 1 B"),
    ("{{ '%s-%d' | format('a', 3) }} {{ [1, 2, 3] | batch(2) | list }} {{ 'one two' | wordcount }}",
     "a-3 [[1, 2], [3]] 2"),
    ("{{ 'hello world foo' | truncate(9, leeway=0) }} [{{ 'ab' | center(6) }}] {{ users[0] | attr('name') is defined }}",
     "hello... [  ab  ] False"),
])
def test_filters(source, expected):
    assert render(source, users=USERS, msgs=MSGS) == expected


@pytest.mark.parametrize("expression, expected", [
    ("x is defined", False), ("x is undefined", True), ("none is none", True), ("0 is none", False),
    ("{} is mapping", True), ("[] is mapping", False), ("'' is string", True), ("1 is string", False),
    ("1 is number", True), ("1.5 is number", True), ("true is number", True), ("'1' is number", False),
    ("1 is integer", True), ("true is integer", False), ("1.0 is integer", False), ("1.0 is float", True),
    ("'ab' is iterable", True), ("1 is iterable", False), ("x is iterable", True),
    ("[] is sequence", True), ("'a' is sequence", True), ("{} is sequence", True), ("1 is sequence", False),
    ("true is boolean", True), ("1 is boolean", False), ("true is true", True), ("1 is true", False),
    ("false is false", True), ("0 is false", False),
    ("'a' is equalto 'a'", True), ("1 is eq 2", False), ("1 is ne 2", True), ("1 is sameas 1", True),
    ("3 is odd", True), ("3 is even", False), ("9 is divisibleby 3", True), ("9 is divisibleby(4)", False),
    ("2 is in [1, 2]", True), ("'x' is in 'abc'", False), ("'ab' is lower", True), ("'Ab' is upper", False),
    ("3 is gt 2", True), ("3 is lt 2", False), ("3 is ge 3", True), ("3 is le 2", False),
    ("range is callable", True), ("x is not defined", True), ("1 is not string", True),
])
def test_tests(expression, expected):
    assert render(f"{{{{ {expression} }}}}") == str(expected)


def test_a_filter_argument_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="line 2: round: method must be common, ceil or floor"):
        render("\n{{ 1.5 | round(0, 'up') }}")
    with pytest.raises(ChatTemplateError, match="line 1: the items filter needs a mapping"):
        render("{{ [1] | items | list }}")
    with pytest.raises(ChatTemplateError, match="line 1: TypeError: Object of type Undefined is not JSON serializable"):
        render("{{ x | tojson }}")
