"""Tool calls read from whole and from streamed text, in every format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from penstock.preprocess.tool_calls import (
    TOOL_CALL_FORMATS,
    ParsedToolCall,
    ToolCallStream,
    split_tool_calls,
)

WEATHER = {"city": "Paris"}
SCHEMAS = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}}}

# Per format: an answer with content (where the format allows it) and two calls, the
# content, and the calls as (name, arguments).
ANSWERS = {
    "hermes": (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check. ",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {}}',
        "",
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}',
        "Let me check.",
    ),
    "pythonic": ('[get_weather(city="Paris"), get_time()]', ""),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "</function>\n</tool_call>",
        "Let me check.\n",
    ),
}
ANSWERS["qwen3_xml"] = ANSWERS["qwen3_coder"]


def calls_of(calls: list[ParsedToolCall]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def streamed(parser: str, pieces: list[str], *, parallel: bool = True) -> tuple[str, list]:
    stream = ToolCallStream(TOOL_CALL_FORMATS[parser], SCHEMAS, parallel=parallel)
    emitted = "".join(stream.feed(piece) for piece in pieces)
    tail, calls = stream.finish()
    return emitted + tail, calls


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_each_format_reads_content_and_calls(parser: str) -> None:
    text, content = ANSWERS[parser]
    split = split_tool_calls(TOOL_CALL_FORMATS[parser], text, SCHEMAS)
    assert split.content == content
    assert calls_of(split.calls) == [("get_weather", WEATHER), ("get_time", {})]
    assert len({call.id for call in split.calls}) == 2


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_parallel_false_keeps_the_first_call(parser: str) -> None:
    text, _ = ANSWERS[parser]
    split = split_tool_calls(TOOL_CALL_FORMATS[parser], text, SCHEMAS, parallel=False)
    assert calls_of(split.calls) == [("get_weather", WEATHER)]


def test_mistral_reads_the_older_json_list_and_makes_its_ids() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    split = split_tool_calls(TOOL_CALL_FORMATS["mistral"], text)
    assert calls_of(split.calls) == [("get_weather", WEATHER)]
    (call,) = split.calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_qwen3_xml_values_take_the_schema_types() -> None:
    text = (
        "<tool_call><function=get_weather><parameter=city>1984</parameter>"
        "<parameter=days>3</parameter><parameter=extra>[1, 2]</parameter></function>"
        "</tool_call>"
    )
    (call,) = split_tool_calls(TOOL_CALL_FORMATS["qwen3_coder"], text, SCHEMAS).calls
    # A string stays a string however it reads; an undeclared parameter stays text.
    assert json.loads(call.arguments) == {"city": "1984", "days": 3, "extra": "[1, 2]"}
    wrong = text.replace(">3<", ">three<")
    (call,) = split_tool_calls(TOOL_CALL_FORMATS["qwen3_coder"], wrong, SCHEMAS).calls
    assert json.loads(call.arguments)["days"] == "three"


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "no calls here"),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> trailing words'),
        ("llama3_json", 'The answer is {"name": "f"}'),
        ("llama3_json", '{"name": "f", "parameters": {}} and more'),
        ("llama3_json", '{"value": 1}'),
        ("mistral", "[TOOL_CALLS]no arguments"),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}'),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[f(x)]"),
        ("pythonic", "[f(x=open('file'))]"),
        ("pythonic", "Sure: [f(x=1)]"),
        ("qwen3_coder", "<tool_call><function=f><parameter=x>1</parameter></tool_call>"),
        ("qwen3_coder", "<tool_call><function=f>stray</function></tool_call>"),
    ],
)
def test_what_does_not_read_as_calls_stays_text(parser: str, text: str) -> None:
    split = split_tool_calls(TOOL_CALL_FORMATS[parser], text, SCHEMAS)
    assert split == (text, [])


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@given(
    st.sampled_from(sorted(ANSWERS)),
    st.lists(st.integers(0, 400), max_size=12),
    st.booleans(),
)
def test_any_split_streams_to_the_whole_text_result(
    parser: str, cuts: list[int], parallel: bool
) -> None:
    text, _ = ANSWERS[parser]
    whole = split_tool_calls(TOOL_CALL_FORMATS[parser], text, SCHEMAS, parallel=parallel)
    content, calls = streamed(parser, pieces_of(text, cuts), parallel=parallel)
    assert content == whole.content
    assert calls_of(calls) == calls_of(whole.calls)


@given(st.sampled_from(sorted(ANSWERS)), st.text(max_size=60), st.lists(st.integers(0, 60)))
def test_any_text_streams_to_the_whole_text_result(parser: str, text: str, cuts: list[int]) -> None:
    whole = split_tool_calls(TOOL_CALL_FORMATS[parser], text, SCHEMAS)
    content, calls = streamed(parser, pieces_of(text, cuts))
    assert content == whole.content
    assert calls_of(calls) == calls_of(whole.calls)
    if not calls:
        assert content == text


def test_content_streams_before_the_calls_begin() -> None:
    stream = ToolCallStream(TOOL_CALL_FORMATS["hermes"])
    assert stream.feed("Let me <tool") == "Let me "
    assert stream.feed("bar> done") == "<toolbar> done"
    assert stream.feed(' <tool_call>{"name": "f"}') == " "
    plain = ToolCallStream(TOOL_CALL_FORMATS["pythonic"])
    assert plain.feed("  ") == ""
    assert plain.feed("Sure.") == "  Sure."
    assert plain.feed(" [f()]") == " [f()]"
