"""Tool calls the model writes come back as OpenAI ``tool_calls``, in every format."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.openai_spec import spec_errors
from tests.support.server import REPO_ROOT, ServerProcess, running_server

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]

# Per parser: what the model writes, the content the answer shows, and its calls.
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
REPLIES = {
    "hermes": (
        'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "On it. ",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
    ),
    "mistral": (
        'On it.[TOOL_CALLS]get_weather{"city": "Paris", "days": 2}[TOOL_CALLS]get_time{}',
        "On it.",
    ),
    "pythonic": ('[get_weather(city="Paris", days=2), get_time()]', None),
    "qwen3_coder": (
        "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "On it.\n",
    ),
}


@pytest.fixture(scope="module", params=sorted(REPLIES))
def parser_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerProcess]]:
    parser = request.param
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--tool-call-parser", parser]
    args += ["--", "--reply", REPLIES[parser][0]]
    with running_server(args, tmp_path_factory.mktemp(parser)) as process:
        yield parser, process


@pytest.fixture
def parser_client(parser_server: tuple[str, ServerProcess]) -> tuple[str, openai.OpenAI]:
    parser, server = parser_server
    return parser, openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def calls_of(tool_calls: Any) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, list[tuple[str, Any]], str]:
    """A stream's content, its calls (each reassembled from its deltas), its finish reason."""
    chunks = list(
        client.chat.completions.create(
            model="sample-model", messages=MESSAGES, tools=TOOLS, stream=True, **fields
        )
    )
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or []:
            names[call.index] = names.get(call.index, "") + (call.function.name or "")
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    return content, calls, chunks[-1].choices[0].finish_reason


def test_each_parser_reads_the_calls(parser_client: tuple[str, openai.OpenAI]) -> None:
    parser, client = parser_client
    raw = client.chat.completions.with_raw_response.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS
    )
    assert spec_errors("CreateChatCompletionResponse", raw.http_response.json()) == []
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == REPLIES[parser][1]
    assert calls_of(choice.message.tool_calls) == CALLS
    assert len({call.id for call in choice.message.tool_calls}) == 2


def test_a_stream_reassembles_into_the_same_calls(
    parser_client: tuple[str, openai.OpenAI],
) -> None:
    parser, client = parser_client
    content, calls, finish_reason = streamed(client)
    assert content == (REPLIES[parser][1] or "")
    assert calls == CALLS
    assert finish_reason == "tool_calls"


def test_parallel_tool_calls_false_returns_one_call(
    parser_client: tuple[str, openai.OpenAI],
) -> None:
    _, client = parser_client
    response = client.chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False
    )
    assert calls_of(response.choices[0].message.tool_calls) == CALLS[:1]
    assert streamed(client, parallel_tool_calls=False)[1] == CALLS[:1]


def test_tool_choice_none_and_no_tools_leave_the_text(
    parser_client: tuple[str, openai.OpenAI],
) -> None:
    parser, client = parser_client
    none = client.chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].message.content == REPLIES[parser][0]
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"
    content, calls, finish_reason = streamed(client, tool_choice="none")
    assert (content, calls, finish_reason) == (REPLIES[parser][0], [], "stop")
    plain = client.chat.completions.create(model="sample-model", messages=MESSAGES)
    assert plain.choices[0].message.content == REPLIES[parser][0]


@pytest.fixture(scope="module")
def hermes_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--tool-call-parser", "hermes"]
    args += ["--", "--reply", REPLIES["hermes"][0]]
    with running_server(args, tmp_path_factory.mktemp("hermes-choice")) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize(
    ("tool_choice", "reason"),
    [
        ("required", "tool_choice is not supported"),
        ({"type": "function", "function": {"name": "get_time"}}, "tool_choice is not supported"),
        ({"type": "function", "function": {"name": "book_flight"}}, "'book_flight'"),
        ({"type": "function"}, "must be"),
    ],
)
def test_tool_choice_it_cannot_honour_is_a_400_naming_it(
    hermes_client: openai.OpenAI, tool_choice: Any, reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        hermes_client.chat.completions.create(
            model="sample-model", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice"
    assert reason in error["message"]
    # The server keeps serving.
    answer = hermes_client.chat.completions.create(
        model="sample-model", messages=MESSAGES, tools=TOOLS
    )
    assert calls_of(answer.choices[0].message.tool_calls) == CALLS


@pytest.mark.parametrize(
    ("flag", "choices"),
    [
        ("--tool-call-parser", "hermes"),
        ("--reasoning-parser", "'deepseek_r1', 'qwen3'"),
    ],
)
def test_an_unknown_parser_fails_at_start_listing_the_choices(
    tmp_path: Path, flag: str, choices: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "penstock", "serve", "--engine", "sample", flag, "gpt"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"argument {flag}: invalid choice: 'gpt'" in last
    assert choices in last
