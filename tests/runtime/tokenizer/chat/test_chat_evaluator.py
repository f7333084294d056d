"""Expressions as the Jinja2 template docs define them: literals, operators and their precedence (filters bind
tighter than arithmetic, unary minus tighter than ``**``), attribute / item access with Jinja2's fallbacks,
slicing, calls, and the default Undefined (prints empty, falsy, iterates as empty, raises when used)."""

from __future__ import annotations

import pytest

from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError


def render(source: str, **context) -> str:
    return ChatTemplate(source).render(context.pop("messages", []), **context)


@pytest.mark.parametrize("source, expected", [
    ("{{ 1 }} {{ 1.5 }} {{ 'a' }} {{ \"b\" }} {{ 'a' 'b' }}", "1 1.5 a b ab"),
    ("{{ true }} {{ True }} {{ false }} {{ none }} {{ None }}", "True True False None None"),
    ("{{ [1, 'a', [2]] }} {{ {'k': 1, 'j': [none]} }} {{ (1, 2) }} {{ (1,) }} {{ () }}",
     "[1, 'a', [2]] {'k': 1, 'j': [None]} (1, 2) (1,) ()"),
    ("{{ 1_000 }} {{ 0x1f }} {{ 0b101 }} {{ 0o17 }} {{ 1e3 }} {{ 2.5e-1 }}", "1000 31 5 15 1000.0 0.25"),
    ("{{ [1, 2,] }} {{ {'a': 1,} }}", "[1, 2] {'a': 1}"),
])
def test_literals(source, expected):
    assert render(source) == expected


@pytest.mark.parametrize("source, expected", [
    ("{{ 7 / 2 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 4 / 2 }}", "3.5 3 1 1024 2.0"),
    ("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ 10 - 2 - 3 }}", "7 9 64 5"),
    ("{{ -2 ** 2 }}", "4"),  # Jinja2 binds unary minus tighter than ** (Python would give -4)
    ("{{ 'a' + 'b' }} {{ 'ab' * 2 }} {{ [1] + [2] }}", "ab abab [1, 2]"),
    ("{{ 'a' ~ 1 ~ none ~ true ~ missing }}", "a1NoneTrue"),
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 2 >= 2 }} {{ 1 <= 0 }}",
     "True False True True True False"),
    ("{{ 'a' in 'abc' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }} {{ not 'z' in 'abc' }}", "True False True True"),
    ("{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ '' and 'b' }}|{{ not 0 }} {{ not [1] }}", "x b |True False"),
    ("{{ 'y' if true else 'n' }} {{ 'y' if false else 'n' }} [{{ 'y' if false }}] {{ 1 if 0 else 2 if 1 else 3 }}",
     "y n [] 2"),
    ("{{ 'a' + ' b ' | trim }} {{ -3 | abs }} {{ [1, 2] | length + 1 }}", "ab 3 3"),
    ("{{ not none is none }} {{ 3 is odd and 4 is even }} {{ 4 is divisibleby 2 }} {{ 2 is not in [1] }}",
     "False True True True"),
])
def test_operators_and_precedence(source, expected):
    assert render(source) == expected


def test_attribute_and_item_access():
    m = {"role": "user", "content": "hi", "items": 5, 3: "three"}
    assert render("{{ m.role }} {{ m['role'] }} {{ m['items'] }} {{ m[3] }} {{ m.missing is defined }}", m=m) == \
        "user user 5 three False"
    assert render("{{ m.items is callable }} {{ m.get('role') }} {{ m.get('x', 'd') }} {{ m.keys() | list | length }}",
                  m=m) == "True user d 4"  # .items is dict's method: attributes come first for ``.``
    assert render("{{ xs.0 }} {{ xs[-1] }} {{ xs[5] is defined }} {{ 'abc'[1] }} {{ t[0][1] }}",
                  xs=[1, 2, 3], t=[(1, 2)]) == "1 3 False b 2"
    assert render("{{ s.upper }}", s="a").startswith("<built-in method upper")  # a method read, not called


@pytest.mark.parametrize("source, expected", [
    ("{{ xs[1:] }} {{ xs[:2] }} {{ xs[::-1] }} {{ xs[1:3] }} {{ xs[::2] }} {{ xs[-2:] }}",
     "[2, 3, 4] [1, 2] [4, 3, 2, 1] [2, 3] [1, 3] [3, 4]"),
    ("{{ 'hello'[::-1] }} {{ 'hello'[1:-1] }}", "olleh ell"),
])
def test_slicing(source, expected):
    assert render(source, xs=[1, 2, 3, 4]) == expected


@pytest.mark.parametrize("source, expected", [
    ("{{ 'a,b'.split(',') }} {{ 'a b  c'.split() }} {{ 'a,b,c'.rsplit(',', 1) }}", "['a', 'b'] ['a', 'b', 'c'] ['a,b', 'c']"),
    ("[{{ ' x '.strip() }}][{{ 'xxy'.lstrip('x') }}][{{ 'yxx'.rstrip('x') }}]", "[x][y][y]"),
    ("{{ 'ab'.startswith('a') }} {{ 'ab'.endswith(('x', 'b')) }} {{ 'abc'.find('c') }} {{ 'aaa'.count('a') }}",
     "True True 2 3"),
    ("{{ 'Hi {}, {name}'.format('you', name='me') }} {{ 'a-b'.replace('-', '+') }}", "Hi you, me a+b"),
    ("{{ 'abc'.upper() }} {{ 'ABC'.lower() }} {{ 'the end'.title() }}", "ABC abc The End"),
    ("{{ dict(a=1, **{'b': 2}) }} {{ range(*[1, 4]) | list }} {{ d.values() | list }}", "{'a': 1, 'b': 2} [1, 2, 3] [1]"),
])
def test_method_and_function_calls(source, expected):
    assert render(source, d={"k": 1}) == expected


def test_undefined_prints_empty_is_falsy_and_iterates_as_empty():
    assert render("[{{ nothing }}] {{ nothing is defined }} {{ nothing is undefined }} {{ nothing | length }}") == \
        "[] False True 0"
    assert render("{% if nothing %}y{% else %}n{% endif %}{% for x in nothing %}x{% endfor %}") == "n"
    assert render("{{ nothing == nothing }} {{ nothing == none }} {{ 'a' in nothing }}") == "True False False"
    assert render("{{ m.absent is none }} {{ m.absent | default('d') }}", m={}) == "False d"


@pytest.mark.parametrize("source, message", [
    ("{{ nothing + 1 }}", "line 1: 'nothing' is undefined"),
    ("\n{{ m.missing.x }}", "line 2: 'dict object' has no attribute 'missing'"),
    ("{{ xs[9].role }}", "line 1: list object has no element 9"),
    ("{{ nothing() }}", "line 1: 'nothing' is undefined"),
    ("{{ nothing < 1 }}", "line 1: 'nothing' is undefined"),
    ("{% for x in m.missing.y %}{% endfor %}", "line 1: 'dict object' has no attribute 'missing'"),
    ("{{ 1 + 'a' }}", "line 1: TypeError: unsupported operand type"),
    ("{{ 1 / 0 }}", "line 1: ZeroDivisionError: division by zero"),
])
def test_using_an_undefined_or_a_wrong_type_raises_naming_the_line(source, message):
    with pytest.raises(ChatTemplateError, match=message) as error:
        render(source, m={}, xs=[])
    assert "\n" not in str(error.value)


def test_context_variables_shadow_globals():
    assert render("{{ range }}", range="mine") == "mine"
    assert render("{{ tools is none }} {{ tools is defined }} {{ add_generation_prompt }}") == "True True False"
