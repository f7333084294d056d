"""Statements as the Jinja2 template docs define them: for loops (the loop variables, for-else, the inline if filter,
unpacking, break / continue), scoping (a set inside a loop stays there; namespace() carries values out), set
blocks, macros (defaults, varargs / kwargs), filter blocks, raise_exception and the sandbox's refusals."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError


def render(source: str, **context) -> str:
    return ChatTemplate(source).render(context.pop("messages", []), **context)


MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def test_loop_variables():
    source = ("{% for x in 'abc' %}{{ x }}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
              "{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}")
    assert render(source) == "a1032TrueFalse3|b2121FalseFalse3|c3210FalseTrue3|"


def test_previous_and_next_items_are_undefined_at_the_ends():
    source = "{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.nextitem is defined }};{% endfor %}"
    assert render(source) == "-2-True;1-3-True;2--False;"


def test_loop_cycle_and_changed():
    assert render("{% for x in range(4) %}{{ loop.cycle('odd', 'even') }} {% endfor %}") == "odd even odd even "
    assert render("{% for x in [1, 1, 2] %}{{ loop.changed(x) }} {% endfor %}") == "True False True "


def test_for_else_runs_when_nothing_was_iterated():
    assert render("{% for x in [] %}x{% else %}empty{% endfor %}") == "empty"
    assert render("{% for x in missing %}x{% else %}empty{% endfor %}") == "empty"  # undefined iterates as empty
    assert render("{% for x in [1] %}{{ x }}{% else %}empty{% endfor %}") == "1"


def test_the_inline_if_filters_before_counting():
    source = "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }} {{ m.role }};{% endfor %}"
    assert render(source, messages=MESSAGES) == "1/2 user;2/2 assistant;"
    assert render("{% for x in [1, 2] if x > 5 %}x{% else %}none{% endfor %}") == "none"


def test_unpacking_in_for_and_set():
    assert render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", d={"a": 1, "b": 2}) == "a=1;b=2;"
    assert render("{% for a, (b, c) in [(1, (2, 3))] %}{{ a }}{{ b }}{{ c }}{% endfor %}") == "123"
    assert render("{% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %}") == "xy"
    assert render("{% set a, b = 1, 2 %}{{ a }}{{ b }}") == "12"
    with pytest.raises(ChatTemplateError, match="line 1: cannot unpack 3 values into 2 names"):
        render("{% for a, b in [(1, 2, 3)] %}{% endfor %}")


def test_break_and_continue():
    source = ("{% for i in range(10) %}{% if i == 5 %}{% break %}{% endif %}"
              "{% if i is odd %}{% continue %}{% endif %}{{ i }}{% endfor %}")
    assert render(source) == "024"


def test_a_set_inside_a_loop_does_not_outlive_its_iteration():
    # The Jinja2 docs: "it is not possible to set variables inside a block and have them show up outside of it".
    assert render("{% set x = 0 %}{% for i in range(3) %}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}") == "1110"
    assert render("{% for i in range(2) %}{% if i == 0 %}{% set seen = 1 %}{% endif %}[{{ seen }}]{% endfor %}") == "[1][]"
    source = ("{% set iterated = false %}{% for item in [1] %}{% set iterated = true %}{% endfor %}"
              "{% if not iterated %}did not iterate{% endif %}")
    assert render(source) == "did not iterate"


def test_a_set_inside_an_if_is_seen_after_it():
    assert render("{% if true %}{% set x = 'in' %}{% endif %}{{ x }}") == "in"


def test_namespace_carries_values_out_of_loops():
    source = ("{% set ns = namespace(found=false, count=0) %}{% for m in messages %}"
              "{% set ns.count = ns.count + 1 %}{% if m.role == 'user' %}{% set ns.found = true %}{% endif %}"
              "{% endfor %}{{ ns.found }} {{ ns.count }} {{ ns.missing is defined }} {{ ns['count'] }}")
    assert render(source, messages=MESSAGES) == "True 3 False 3"
    assert render("{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}") == "12"
    with pytest.raises(ChatTemplateError, match="line 1: cannot assign attribute 'a' on 'd': it is not a namespace"):
        render("{% set d = {} %}{% set d.a = 1 %}")


def test_block_set_captures_the_rendered_body():
    assert render("{% set greeting %}Hello {{ name }}{% endset %}[{{ greeting }}]", name="Ann") == "[Hello Ann]"
    assert render("{% set shout | upper | trim %} abc {% endset %}[{{ shout }}]") == "[ABC]"
    assert render("{% set x %}{% set inner = 1 %}{% endset %}{{ inner is defined }}") == "False"


def test_macros_with_defaults_and_keywords():
    source = ("{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}"
              "{{ greet('Ann') }} {{ greet('Bo', greeting='Hi') }} {{ greet(name='Cy') }}")
    assert render(source) == "Hello, Ann! Hi, Bo! Hello, Cy!"
    assert render("{% macro f(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}{{ f(1) }}") == "[1||False]"
    assert render("{% macro f(a, b=a * 2) %}{{ b }}{% endmacro %}{{ f(3) }}") == "6"


def test_macro_varargs_and_kwargs_only_when_the_body_uses_them():
    source = "{% macro f(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ f(1, 2, 3, k=4) }}"
    assert render(source) == "1(2, 3){'k': 4}"
    with pytest.raises(ChatTemplateError, match=r"line 1: TypeError: macro 'f' takes not more than 1 argument\(s\)"):
        render("{% macro f(a) %}{{ a }}{% endmacro %}{{ f(1, 2) }}")
    with pytest.raises(ChatTemplateError, match="macro 'f' takes no keyword argument 'b'"):
        render("{% macro f(a) %}{{ a }}{% endmacro %}{{ f(1, b=2) }}")


def test_macros_see_the_template_and_keep_their_own_sets():
    source = ("{% set suffix = '!' %}{% macro f(x) %}{% set local = x ~ suffix %}{{ local }}{% endmacro %}"
              "{{ f('a') }}{{ local is defined }}")
    assert render(source) == "a!False"


def test_filter_blocks():
    assert render("{% filter upper %}abc {{ 'd' }}{% endfilter %}") == "ABC D"
    assert render("{% filter replace('a', 'o') | upper %}banana{% endfilter %}") == "BONONO"


def test_if_elif_else():
    source = "{% for n in [1, 2, 3] %}{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %} {% endfor %}"
    assert render(source) == "one two many "


def test_raise_exception_carries_the_templates_message():
    source = "{% for m in messages %}\n{% if m.role == 'tool' %}\n{{ raise_exception('no tools here') }}\n{% endif %}{% endfor %}"
    with pytest.raises(ChatTemplateError) as error:
        render(source, messages=[{"role": "tool", "content": ""}])
    assert str(error.value) == "chat template line 3: no tools here"
    assert error.value.template_message == "no tools here" and error.value.line == 3


def test_strftime_now_formats_the_current_time():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = render("{{ strftime_now('%Y-%m-%d') }}")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rendered) and rendered in (before, datetime.now().strftime("%Y-%m-%d"))


def test_the_sandbox_refuses_changing_a_value():
    with pytest.raises(ChatTemplateError, match=r"line 1: access to attribute 'append' of 'list' object is unsafe\."):
        render("{% set xs = [] %}{{ xs.append(1) }}")
    with pytest.raises(ChatTemplateError, match="access to attribute 'update' of 'dict' object is unsafe"):
        render("{% set d = {} %}{{ d.update({'a': 1}) }}")
    assert render("{% set xs = [] %}{{ xs.append is defined }}") == "False"  # refused, not called


def test_the_sandbox_hides_underscore_attributes():
    assert render("[{{ ''.__class__ }}]") == "[]"  # an unsafe value prints as empty, as Jinja2's Undefined does
    with pytest.raises(ChatTemplateError, match="access to attribute '__class__' of 'str' object is unsafe"):
        render("{{ ''.__class__.__mro__ }}")
    assert render("[{{ '{0.__class__}'.format(1) }}]") == "[]"  # str.format goes through the sandbox too
    assert render("{{ '{0[a]}-{1}'.format(d, 2) }}", d={"a": "x"}) == "x-2"


def test_range_is_capped_as_in_the_sandbox():
    assert render("{{ range(3)|list }}{{ range(1, 7, 2)|list }}") == "[0, 1, 2][1, 3, 5]"
    with pytest.raises(ChatTemplateError, match="range too big"):
        render("{{ range(200000) }}")
