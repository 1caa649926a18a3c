from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

import pytest

from penstock.errors import InvalidRequestError
from penstock.preprocess import Preprocessor

WithTemplate = Callable[[str], Preprocessor]


def test_chatml_renders_every_role_in_order(preprocessor: Preprocessor) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]

    assert preprocessor.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>developer\nAnswer in English.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.<|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_add_generation_prompt_off_leaves_no_open_assistant_turn(
    preprocessor: Preprocessor,
) -> None:
    rendered = preprocessor.render_chat(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_text_parts_are_joined_and_media_parts_left_out(preprocessor: Preprocessor) -> None:
    content = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "text", "text": "this picture."},
    ]
    rendered = preprocessor.render_chat([{"role": "user", "content": content}])

    assert rendered.startswith("<|im_start|>user\nDescribe\nthis picture.<|im_end|>\n")
    assert "example.com" not in rendered


def test_null_content_renders_as_empty_text(preprocessor: Preprocessor) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    rendered = preprocessor.render_chat(messages, add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>assistant\n<|im_end|>\n")


def test_rendering_leaves_the_callers_messages_untouched(preprocessor: Preprocessor) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    preprocessor.render_chat(messages)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_a_message_that_is_not_an_object_is_named_in_the_error(
    preprocessor: Preprocessor,
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        preprocessor.render_chat([{"role": "user", "content": "hi"}, "hello"])  # type: ignore[list-item]
    assert caught.value.param == "messages[1]"
    assert caught.value.message == "messages[1] must be an object, not str"


def test_tokenize_chat_is_render_then_encode(preprocessor: Preprocessor) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    ids = preprocessor.tokenize_chat(messages)

    assert ids == preprocessor.encode(preprocessor.render_chat(messages))
    assert ids[0] == preprocessor.encode("<|im_start|>")[0]
    assert preprocessor.decode(ids, skip_special_tokens=False) == preprocessor.render_chat(messages)


def test_chat_template_kwargs_reach_the_template(with_template: WithTemplate) -> None:
    preprocessor = with_template(
        "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %}"
        " /no_think{% endif %}"
    )
    user = [{"role": "user", "content": "hi"}]

    assert preprocessor.render_chat(user) == "hi"
    assert preprocessor.render_chat(user, chat_template_kwargs={"enable_thinking": False}) == (
        "hi /no_think"
    )


def test_chat_template_kwargs_cannot_replace_the_messages(preprocessor: Preprocessor) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        preprocessor.render_chat(
            [{"role": "user", "content": "hi"}],
            chat_template_kwargs={"messages": [], "add_generation_prompt": False},
        )
    assert caught.value.param == "chat_template_kwargs"
    assert "add_generation_prompt, messages" in caught.value.message


def test_special_tokens_are_template_variables(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}")
    assert preprocessor.render_chat([]) == "<|im_end|>|<pad>|False"


def test_tools_reach_the_template_as_unescaped_json(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ tools | tojson }}")
    tools = [{"type": "function", "function": {"name": "lt", "description": "a < b & ü"}}]

    assert json.loads(preprocessor.render_chat([], tools=tools)) == tools
    assert "a < b & ü" in preprocessor.render_chat([], tools=tools)


def test_tool_call_arguments_reach_the_template_as_an_object(with_template: WithTemplate) -> None:
    preprocessor = with_template(
        "{% for call in messages[0].tool_calls %}"
        "{{ call.function.name }}({{ call.function.arguments.city }})"
        "{% endfor %}"
    )
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert preprocessor.render_chat([message]) == "weather(Oslo)"


def test_template_calling_raise_exception_is_a_bad_request(with_template: WithTemplate) -> None:
    preprocessor = with_template(
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}"
        "{% endif %}"
    )
    with pytest.raises(InvalidRequestError) as caught:
        preprocessor.render_chat([{"role": "assistant", "content": "hi"}])

    assert caught.value.status_code == 400
    assert caught.value.param == "messages"
    assert "Conversations must start with a user message" in caught.value.message


def test_sandbox_refuses_attribute_access_to_internals(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="unsafe"):
        preprocessor.render_chat([])


def test_sandbox_refuses_mutating_request_data(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ messages.append({'role': 'system'}) }}")
    with pytest.raises(InvalidRequestError, match="unsafe"):
        preprocessor.render_chat([])


def test_namespace_refuses_underscore_names(with_template: WithTemplate) -> None:
    preprocessor = with_template("{% set ns = namespace(_secret=1) %}{{ ns._secret }}")
    with pytest.raises(InvalidRequestError, match="underscore"):
        preprocessor.render_chat([])


def test_template_type_error_is_a_bad_request(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ messages[0].content + 1 }}")
    with pytest.raises(InvalidRequestError, match="could not render"):
        preprocessor.render_chat([{"role": "user", "content": "hi"}])


def test_loop_controls_and_whitespace_control_match_transformers(
    with_template: WithTemplate,
) -> None:
    preprocessor = with_template(
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "{{ m.content }};\n"
        "{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    assert preprocessor.render_chat(messages) == "u;\na;\n"


def test_generation_block_renders_its_body(with_template: WithTemplate) -> None:
    preprocessor = with_template(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert preprocessor.render_chat([{"role": "assistant", "content": "done"}]) == "done"


def test_strftime_now_gives_the_current_date(with_template: WithTemplate) -> None:
    preprocessor = with_template("{{ strftime_now('%Y-%m') }}")
    before = f"{datetime.now():%Y-%m}"
    rendered = preprocessor.render_chat([])
    assert rendered in {before, f"{datetime.now():%Y-%m}"}


def test_templates_that_loop_over_content_get_media_parts_in_place(
    with_template: WithTemplate,
) -> None:
    hf_style = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
        "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    messages = [{"role": "user", "content": parts}]
    assert with_template(hf_style).render_chat(messages) == "Compare <image> and <image>"
    # Text-only content is one string, whatever the template expects.
    text_only = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert with_template(hf_style).render_chat(text_only) == "a\nb"
    filtered = with_template(
        "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'image') %}"
        "[IMG]{% endfor %}{% endfor %}"
    )
    assert filtered.render_chat(messages) == "[IMG][IMG]"
    # A template that prints content as a string still gets the text parts joined.
    assert with_template("{{ messages[0]['content'] }}").render_chat(messages) == (
        "Compare \n and "
    )
