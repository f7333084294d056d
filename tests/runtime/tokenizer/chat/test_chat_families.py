"""A realistic template of another family, written here in Gemma's style (system text folded into the first user
turn, "model" for the assistant, strict alternation with raise_exception, a macro per turn, namespace() to carry
the system text out of a loop, loop.first, a block whose whitespace trim_blocks / lstrip_blocks decide), with
every expected text worked out by hand from the template's rules."""

from __future__ import annotations

import pytest

from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError

GEMMA_STYLE = r"""{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages if message.role == 'system' %}
    {%- set ns.system = ns.system + message.content | trim + '\n\n' %}
{%- endfor %}
{%- macro turn(role, text) -%}
<start_of_turn>{{ role }}
{{ text | trim }}<end_of_turn>
{% endmacro %}
{%- for message in messages if message.role != 'system' %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' ~ message.role) }}
    {%- endif %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set role = 'model' if message.role == 'assistant' else 'user' %}
    {%- if loop.first %}
        {{- turn(role, ns.system ~ message.content) }}
    {%- else %}
        {{- turn(role, message.content) }}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""

CONVERSATION = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "  Hi there "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(GEMMA_STYLE, special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"})


def test_the_system_text_joins_the_first_user_turn(template):
    expected = ("<bos><start_of_turn>user\nBe brief.\n\n  Hi there<end_of_turn>\n"
                "<start_of_turn>model\nHello!<end_of_turn>\n"
                "<start_of_turn>user\nBye<end_of_turn>\n"
                "<start_of_turn>model\n")
    assert template.render(CONVERSATION, add_generation_prompt=True) == expected


def test_without_a_system_message_or_a_generation_prompt(template):
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": " A. "}]
    assert template.render(messages) == "<bos><start_of_turn>user\nQ?<end_of_turn>\n<start_of_turn>model\nA.<end_of_turn>\n"


def test_the_assistant_span_is_its_text_and_end_of_turn(template):
    rendering = template.render_with_assistant_spans(CONVERSATION, end_markers=("<end_of_turn>",))
    assert [rendering.text[a:b] for a, b in rendering.assistant_spans] == ["Hello!<end_of_turn>"]
    assert rendering.text[: rendering.assistant_spans[0][0]].endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "Unknown role: tool"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "Conversation roles must alternate user/assistant/user/assistant/..."),
    ([{"role": "assistant", "content": "a"}], "Conversation roles must alternate user/assistant/user/assistant/..."),
])
def test_bad_roles_raise_the_templates_message(template, messages, message):
    with pytest.raises(ChatTemplateError) as error:
        template.render(messages)
    assert error.value.template_message == message
    assert str(error.value) == f"chat template line {12 if 'Unknown' in message else 15}: {message}"
