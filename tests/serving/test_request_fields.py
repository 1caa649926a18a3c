"""OpenAI's and vLLM's request fields as the serving layer reads them, and what the
response says of the fields it ignored."""

from __future__ import annotations

from penstock.schemas.fields import ignored_fields_header, refuse_or_ignore
from penstock.schemas.openai import ChatCompletionRequest

HI = [{"role": "user", "content": "hi"}]


def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it() -> None:
    plain = ChatCompletionRequest.model_validate({"messages": HI})
    assert plain.template_kwargs is None
    low = ChatCompletionRequest.model_validate({"messages": HI, "reasoning_effort": "low"})
    assert low.template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    off = ChatCompletionRequest.model_validate({"messages": HI, "reasoning_effort": "none"})
    assert off.template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    # The request's own template kwargs win.
    mine = ChatCompletionRequest.model_validate(
        {
            "messages": HI,
            "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert mine.template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}


def test_the_ignored_fields_header_is_ascii_and_taken_once() -> None:
    assert ignored_fields_header() is None
    refuse_or_ignore(["x" * 5000], allowed=True)
    bounded = ignored_fields_header()
    assert bounded is not None and bounded[1] == b"x" * 1024
    refuse_or_ignore(["colour", "messages[0].\u00e9t\u00e9\n"], allowed=True)
    refuse_or_ignore(["colour"], allowed=True)
    header = ignored_fields_header()
    assert header == (b"x-penstock-ignored-fields", b"colour, messages[0].\\xe9t\\xe9?")
    assert ignored_fields_header() is None
    refuse_or_ignore(["x" * 5000], allowed=True)
    bounded = ignored_fields_header()
    assert bounded is not None and bounded[1] == b"x" * 1024
