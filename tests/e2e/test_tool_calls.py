"""Tool calls the model writes come back as OpenAI ``tool_calls``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_server

REPLY = 'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--tool-call-parser", "hermes"]
    args += ["--", "--reply", REPLY]
    with running_server(args, tmp_path_factory.mktemp("tools")) as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_non_stream_tool_calls(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS
    )
    assert spec_errors("CreateChatCompletionResponse", raw.http_response.json()) == []
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "On it. "
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_stream_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "On it. "
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert last.delta.tool_calls[0].function.name == "get_weather"
    assert last.delta.tool_calls[0].index == 0


def test_without_tools_the_text_is_plain(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="sample-model", messages=MESSAGES)
    assert response.choices[0].message.content == REPLY
    assert response.choices[0].finish_reason == "stop"
    none = client.chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].message.tool_calls is None


def test_forcing_a_call_is_refused_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="sample-model", messages=MESSAGES, tools=TOOLS, tool_choice="required"
        )
    assert "tool_choice" in str(refused.value)
