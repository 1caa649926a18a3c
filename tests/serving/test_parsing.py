"""Which parsers a chat request's answer gets, from the request and the server's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from penstock.errors import InvalidRequestError
from penstock.preprocess import Preprocessor
from penstock.schemas.openai import ChatCompletionRequest
from penstock.serving.parsing import output_parsing

SAMPLE_TOKENIZER = Path(__file__).parents[2] / "penstock/engines/assets/sample-tokenizer"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor.from_folder(SAMPLE_TOKENIZER)


def body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_qwen3_opens_in_reasoning_when_the_prompt_does(preprocessor: Preprocessor) -> None:
    opened = preprocessor.encode("<|im_start|>assistant\n<think>\n")
    closed = preprocessor.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parsing = output_parsing(body(), None, "qwen3", preprocessor, opened)
    assert parsing is not None and parsing.reasoning_opened is True
    parsing = output_parsing(body(), None, "qwen3", preprocessor, closed)
    assert parsing is not None and parsing.reasoning_opened is False


def test_enable_thinking_false_turns_reasoning_off(preprocessor: Preprocessor) -> None:
    off = body(chat_template_kwargs={"enable_thinking": False})
    assert output_parsing(off, None, "deepseek_r1", preprocessor, [1, 2]) is None


def test_calls_are_read_only_with_tools_a_parser_and_a_choice_that_allows_them() -> None:
    assert output_parsing(body(), "hermes", None, None, []) is None
    assert output_parsing(body(tools=TOOLS), None, None, None, []) is None
    assert output_parsing(body(tools=TOOLS, tool_choice="none"), "hermes", None, None, []) is None
    parsing = output_parsing(body(tools=TOOLS, parallel_tool_calls=False), "hermes", None, None, [])
    assert parsing is not None and parsing.parallel_tool_calls is False
    assert parsing.reasoning_opened is None and "get_time" in parsing.tools


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_forced_call_is_read_as_calls(tool_choice: Any) -> None:
    parsing = output_parsing(body(tools=TOOLS, tool_choice=tool_choice), "hermes", None, None, [])
    assert parsing is not None and parsing.tool_format is not None


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "book_flight"}}, {"function": {}}],
)
def test_a_choice_naming_no_known_function_is_refused(tool_choice: Any) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        output_parsing(body(tools=TOOLS, tool_choice=tool_choice), "hermes", None, None, [])
    assert refused.value.param == "tool_choice"


NAMED = {"type": "function", "function": {"name": "get_time"}}
CUT_CALL = '<tool_call>\n{"name": "get_'
WHOLE_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def _parsed(request: ChatCompletionRequest, pieces: list[str]) -> tuple[str, list[str]]:
    """The content a choice's text ``pieces`` become, and the names of the calls read."""
    parsing = output_parsing(request, "hermes", None, None, [])
    assert parsing is not None
    parser = parsing.for_choice()
    content, names = "", []
    for position, piece in enumerate(pieces):
        chunk = parser.feed(piece, finished=position == len(pieces) - 1)
        content += chunk.content
        names += [call.name for call in chunk.calls]
    return content, names


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_streamed_forced_call_cut_short_streams_no_content(tool_choice: Any) -> None:
    request = body(tools=TOOLS, tool_choice=tool_choice, stream=True)
    assert _parsed(request, [CUT_CALL[:5], CUT_CALL[5:]]) == ("", [])
    assert _parsed(request, [WHOLE_CALL[:20], WHOLE_CALL[20:]]) == ("", ["get_time"])


def test_a_forced_call_cut_short_stays_content_when_not_streamed() -> None:
    request = body(tools=TOOLS, tool_choice=NAMED)
    assert _parsed(request, [CUT_CALL]) == (CUT_CALL, [])


def test_an_unforced_streamed_answer_keeps_its_text() -> None:
    request = body(tools=TOOLS, tool_choice="auto", stream=True)
    assert _parsed(request, ["It is noon. ", CUT_CALL]) == ("It is noon. " + CUT_CALL, [])
