"""A thinking model's reasoning comes back apart from its answer, and out of its calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_server

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]

# DeepSeek-R1 style: the template opened the block; a call written while thinking is
# part of the reasoning, not a call.
THOUGHT = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>?'
ANSWER = 'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
R1_REPLY = f"{THOUGHT}</think>{ANSWER}"
QWEN_REPLY = "<think>Paris is rainy.</think>Take an umbrella."


def serve(reply: str, *args: str, log_dir: Any) -> Any:
    flags = ["--engine", "tests.support.doubles:ReplyEngine", *args, "--", "--reply", reply]
    return running_server(flags, log_dir)


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes")
    with serve(R1_REPLY, *args, log_dir=tmp_path_factory.mktemp("r1")) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve(
        QWEN_REPLY, "--reasoning-parser", "qwen3", log_dir=tmp_path_factory.mktemp("q")
    ) as s:
        yield s


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def streamed(client: openai.OpenAI, **fields: Any) -> dict[str, Any]:
    chunks = list(
        client.chat.completions.create(
            model="sample-model", messages=MESSAGES, stream=True, **fields
        )
    )
    deltas = [chunk.choices[0].delta for chunk in chunks]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    return {
        "reasoning_content": "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
        "reasoning": "".join(getattr(d, "reasoning", None) or "" for d in deltas),
        "content": "".join(delta.content or "" for delta in deltas),
        "calls": [(call.function.name, json.loads(call.function.arguments)) for call in calls],
        "finish_reason": chunks[-1].choices[0].finish_reason,
    }


def test_reasoning_is_kept_out_of_the_content(r1_server: ServerProcess) -> None:
    raw = client_of(r1_server).chat.completions.with_raw_response.create(
        model="sample-model", messages=MESSAGES
    )
    assert spec_errors("CreateChatCompletionResponse", raw.http_response.json()) == []
    message = raw.parse().choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == THOUGHT
    assert message.reasoning == THOUGHT
    assert message.tool_calls is None


def test_reasoning_is_kept_out_of_the_tool_calls(r1_server: ServerProcess) -> None:
    response = client_of(r1_server).chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == THOUGHT
    assert choice.message.content == "On it. "
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("with_tools", [False, True])
def test_a_stream_splits_as_the_whole_answer_does(
    r1_server: ServerProcess, with_tools: bool
) -> None:
    client = client_of(r1_server)
    fields: dict[str, Any] = {"tools": TOOLS} if with_tools else {}
    whole = client.chat.completions.create(model="sample-model", messages=MESSAGES, **fields)
    message = whole.choices[0].message
    stream = streamed(client, **fields)
    assert stream["reasoning_content"] == stream["reasoning"] == THOUGHT
    assert stream["content"] == (message.content or "")
    assert stream["calls"] == [
        (call.function.name, json.loads(call.function.arguments))
        for call in message.tool_calls or []
    ]
    assert stream["finish_reason"] == whole.choices[0].finish_reason


def test_generate_returns_the_raw_text(r1_server: ServerProcess) -> None:
    reply = httpx.post(
        f"{r1_server.base_url}/generate",
        json={"text": "Weather in Paris?", "sampling_params": {"max_new_tokens": 200}},
        timeout=30,
    )
    assert reply.status_code == 200
    assert reply.json()["text"] == R1_REPLY


def test_qwen3_reads_the_think_block(qwen_server: ServerProcess) -> None:
    client = client_of(qwen_server)
    message = client.chat.completions.create(model="sample-model", messages=MESSAGES)
    assert message.choices[0].message.content == "Take an umbrella."
    assert message.choices[0].message.reasoning_content == "Paris is rainy."
    stream = streamed(client)
    assert (stream["reasoning_content"], stream["content"]) == (
        "Paris is rainy.",
        "Take an umbrella.",
    )


def test_with_thinking_off_nothing_is_reasoning(qwen_server: ServerProcess) -> None:
    client = client_of(qwen_server)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    response = client.chat.completions.create(
        model="sample-model", messages=MESSAGES, extra_body=off
    )
    message = response.choices[0].message
    assert message.content == QWEN_REPLY
    assert getattr(message, "reasoning_content", None) is None
    stream = streamed(client, extra_body=off)
    assert (stream["reasoning_content"], stream["content"]) == ("", QWEN_REPLY)


def test_without_a_reasoning_parser_there_is_no_reasoning_field(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with serve(QWEN_REPLY, log_dir=tmp_path_factory.mktemp("plain")) as server:
        raw = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "sample-model", "messages": MESSAGES},
            timeout=30,
        ).json()
    message = raw["choices"][0]["message"]
    assert message["content"] == QWEN_REPLY
    assert "reasoning_content" not in message and "reasoning" not in message


def test_an_answer_with_reasoning_goes_back_as_the_next_turn(r1_server: ServerProcess) -> None:
    client = client_of(r1_server)
    first = client.chat.completions.create(model="sample-model", messages=MESSAGES, tools=TOOLS)
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    turns = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "rain"},
    ]
    second = client.chat.completions.create(model="sample-model", messages=turns, tools=TOOLS)
    assert second.choices[0].message.reasoning_content == THOUGHT


def test_responses_give_reasoning_its_own_item_whole_and_streamed(
    qwen_server: ServerProcess,
) -> None:
    from tests.e2e.test_responses import sse_events
    from tests.support.openai_spec import stream_event_schema

    client = client_of(qwen_server)
    answer = client.responses.create(model="sample-model", input="Umbrella?")
    reasoning, _ = answer.output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content or []] == ["Paris is rainy."]
    assert answer.output_text == "Take an umbrella."

    body = {"model": "sample-model", "input": "Umbrella?", "stream": True}
    with httpx.Client(base_url=qwen_server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/responses", json=body) as streamed_answer:
            events = [event for _, event in sse_events(streamed_answer)]
    for event in events:
        assert spec_errors(stream_event_schema(event["type"]), event) == [], event
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Paris is rainy."
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Take an umbrella."
    assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} == {1}
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
