"""ChatTemplate against transformers' own renders: the three chat fixture folders (tests/fixtures/tokenizers/chat,
made by transformers 5.24.0 with the released Llama 3, Qwen2.5 and Mixtral templates), every case's text, assistant
spans, ids and token spans exactly; reading a folder's template and special tokens; spans from {% generation %}."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.tokenizer import char_spans_to_token_spans, load_tokenizer
from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "tokenizers" / "chat"
END_MARKERS = {"llama3-style": ("<|eot_id|>",), "qwen2-style": ("<|im_end|>",), "sentencepiece-style": ("</s>",)}


def _cases(style: str) -> list[tuple[dict, dict]]:
    cases = json.loads((FIXTURES / style / "cases.json").read_text(encoding="utf-8"))["cases"]
    expected = json.loads((FIXTURES / style / "expected.json").read_text(encoding="utf-8"))["cases"]
    assert [c["name"] for c in cases] == [e["name"] for e in expected] and len(cases) == 6
    return list(zip(cases, expected))


@pytest.mark.parametrize("style", sorted(END_MARKERS))
def test_every_fixture_case_renders_as_transformers_does(style):
    template = ChatTemplate.from_folder(FIXTURES / style)
    for case, expected in _cases(style):
        text = template.render(case["messages"], tools=case.get("tools"),
                               add_generation_prompt=case["add_generation_prompt"])
        assert text == expected["text"], case["name"]


@pytest.mark.parametrize("style", sorted(END_MARKERS))
def test_assistant_spans_and_token_spans_match_the_fixtures(style):
    template = ChatTemplate.from_folder(FIXTURES / style)
    tokenizer = load_tokenizer(FIXTURES / style)
    for case, expected in _cases(style):
        rendering = template.render_with_assistant_spans(case["messages"], tools=case.get("tools"),
                                                         add_generation_prompt=case["add_generation_prompt"],
                                                         end_markers=END_MARKERS[style])
        assert rendering.text == expected["text"], case["name"]
        assert [list(s) for s in rendering.assistant_spans] == expected["assistant_spans"], case["name"]
        assert [rendering.text[a:b] for a, b in rendering.assistant_spans] == expected["assistant_texts"]
        ids = tokenizer.encode(rendering.text)
        assert ids == expected["ids"], case["name"]
        token_spans = char_spans_to_token_spans(tokenizer, rendering.text, rendering.assistant_spans, ids=ids)
        assert [list(s) for s in token_spans] == expected["assistant_token_spans"], case["name"]


def test_assistant_spans_is_the_rendering_spans():
    case, expected = _cases("qwen2-style")[4]  # tool_calls: two assistant turns
    template = ChatTemplate.from_folder(FIXTURES / "qwen2-style")
    spans = template.assistant_spans(case["messages"], tools=case["tools"], end_markers=("<|im_end|>",))
    assert [list(s) for s in spans] == expected["assistant_spans"]


def test_special_tokens_come_from_the_config_as_strings_or_content_objects(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<B>", "lstrip": False}, "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<ignored>", "eos_token": "<E>"}))
    assert ChatTemplate.from_folder(tmp_path).render([]) == "<B>|<E>|"
    assert ChatTemplate.from_folder(tmp_path).render([], eos_token="<kw>") == "<B>|<kw>|"  # a keyword wins


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    shutil.copy(FIXTURES / "llama3-style" / "tokenizer_config.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }};{% endfor %}\n")
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "hi"}]) == "hi;"


def test_a_named_template_file_is_read_by_name(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "plain"}))
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("with tools")
    assert ChatTemplate.from_folder(tmp_path).render([]) == "plain"
    assert ChatTemplate.from_folder(tmp_path, name="tool_use").render([]) == "with tools"
    with pytest.raises(ChatTemplateError, match="chat_template is a single template, there is none named 'rag'"):
        ChatTemplate.from_folder(tmp_path, name="rag")


def test_a_list_of_named_templates_picks_default_or_the_asked_name(tmp_path):
    templates = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert ChatTemplate.from_folder(tmp_path).render([]) == "plain"
    assert ChatTemplate.from_folder(tmp_path, name="tool_use").render([], tools=[{}, {}]) == "tools: 2"
    with pytest.raises(ChatTemplateError, match=r"no template named 'rag' \(it has 'default', 'tool_use'\)"):
        ChatTemplate.from_folder(tmp_path, name="rag")


@pytest.mark.parametrize("config, message", [
    ({}, r"no chat template \(neither chat_template.jinja nor chat_template in tokenizer_config.json\)"),
    ({"chat_template": 3}, r"chat_template must be a string or a list of \{name, template\} objects"),
    ({"chat_template": "x", "eos_token": 5}, r"eos_token must be a string or \{\"content\": ...\}"),
])
def test_a_folder_without_a_readable_template_says_what_is_wrong(tmp_path, config, message):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate.from_folder(tmp_path)


GENERATION = ("{% for m in messages %}<{{ m.role }}>"
              "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<end>{% endgeneration %}"
              "{% else %}{{ m.content }}{% endif %}{% endfor %}")


def test_generation_blocks_give_the_spans_and_render_their_body():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bb"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "dd"}]
    rendering = ChatTemplate(GENERATION).render_with_assistant_spans(messages)
    assert rendering.text == "<user>a<assistant>bb<end><user>c<assistant>dd<end>"
    assert [rendering.text[a:b] for a, b in rendering.assistant_spans] == ["bb<end>", "dd<end>"]
    assert ChatTemplate(GENERATION).render(messages) == rendering.text


def test_a_generation_block_inside_a_macro_has_no_span():
    template = ChatTemplate("{% macro turn(m) %}{% generation %}{{ m }}{% endgeneration %}{% endmacro %}{{ turn('x') }}")
    assert template.render([]) == "x"
    with pytest.raises(ChatTemplateError, match="line 1: a {% generation %} block inside a macro"):
        template.render_with_assistant_spans([])


def test_spans_need_end_markers_and_a_prefix_render():
    template = ChatTemplate.from_folder(FIXTURES / "llama3-style")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatTemplateError, match="end_markers must name the end-of-turn texts"):
        template.assistant_spans(messages)
    with pytest.raises(ChatTemplateError, match=r"assistant message 1: no end-of-turn marker \['<\|im_end\|>'\]"):
        template.assistant_spans(messages, end_markers=("<|im_end|>",))
    # A template that renders its last turn differently from earlier ones has no prefix spans.
    last_differs = ChatTemplate("{% for m in messages %}{{ m.content }}{{ '.' if loop.last else ';' }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"assistant message 1: messages\[:1\] with the generation prompt "
                                                r"does not render to a prefix"):
        last_differs.assistant_spans(messages + [{"role": "user", "content": "r"}], end_markers=(";",))
