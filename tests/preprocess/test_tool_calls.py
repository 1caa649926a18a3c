"""Hermes-style tool calls parsed from whole and from streamed text."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from penstock.preprocess.tool_calls import ToolCallStream, parse_hermes

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_content_then_calls() -> None:
    parsed = parse_hermes("Let me check. " + CALL + CALL.replace("Paris", "Lyon"))
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me check. "
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Lyon"}
    openai_call = calls[0].as_openai(0)
    assert openai_call["type"] == "function" and openai_call["id"].startswith("call_")


def test_malformed_or_absent_calls_stay_text() -> None:
    assert parse_hermes("no calls here") is None
    assert parse_hermes("<tool_call>{not json}</tool_call>") is None
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>') is None
    assert parse_hermes(CALL + " trailing words") is None


@given(st.lists(st.integers(0, len(CALL) + 20), max_size=8), st.sampled_from(["", "Sure. "]))
def test_streaming_any_split_gives_the_whole_text_result(cuts: list[int], prefix: str) -> None:
    text = prefix + CALL
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    stream = ToolCallStream()
    emitted = "".join(stream.feed(piece) for piece in pieces)
    tail, calls = stream.finish()
    assert emitted + tail == prefix
    assert [c.name for c in calls] == ["get_weather"]


@given(st.text(max_size=40))
def test_plain_text_streams_through_unchanged(text: str) -> None:
    stream = ToolCallStream()
    out = "".join(stream.feed(ch) for ch in text)
    tail, calls = stream.finish()
    if "<tool_call>" not in text:
        assert out + tail == text and calls == []
