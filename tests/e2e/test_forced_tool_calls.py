"""``tool_choice`` ``required`` and named calls, constrained in every tool-call format.

A tiny checkpoint with random weights writes a call the parser reads, with arguments
valid against the tool's schema, only when the grammar holds it to that: so every call
of every sample must parse and validate, streamed or not, for each ``--tool-call-parser``.
Parallel calls are checked on the grammars themselves (``tests/serving/test_tool_grammars``):
after each call another may follow, so a random model rarely ends a parallel answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.server import ServerProcess, running_servers, transformers_args
from tests.support.tiny_llm import build_tiny_llama

MESSAGES: list[Any] = [{"role": "user", "content": "Plan my day."}]
PARSERS = ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
# A random model ends a free string only by chance: strings here are bounded.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "loud": {"type": "boolean"},
                    "label": {"type": ["string", "null"], "maxLength": 8},
                    "repeat": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                    "snooze": {"type": "number"},
                },
                "required": ["loud", "label"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """A server per parser, all started together: their start-ups overlap."""
    engine = ("--served-model-name", "tiny", "--max-num-seqs", "8")
    starts = [
        (
            transformers_args(model_dir, "--tool-call-parser", parser, engine_args=engine),
            tmp_path_factory.mktemp(parser),
        )
        for parser in PARSERS
    ]
    with running_servers(starts, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=240) as started:
        yield dict(zip(PARSERS, started, strict=True))


@pytest.fixture(scope="module", params=PARSERS)
def client(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]) -> openai.OpenAI:
    base_url = servers[request.param].base_url
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def forced(client: openai.OpenAI, tool_choice: Any, *, n: int, seed: int, **extra: Any) -> Any:
    """``n`` samples of at most 200 tokens on ``TOOLS``, held to ``tool_choice``."""
    return client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice,
        n=n,
        max_tokens=200,
        seed=seed,
        **extra,
    )


def test_required_without_parallel_calls_once_with_valid_arguments(
    client: openai.OpenAI,
) -> None:
    completion = forced(client, "required", n=6, seed=11, parallel_tool_calls=False)
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert not choice.message.content
        (call,) = choice.message.tool_calls or []
        _valid(call.function.name, call.function.arguments)


def test_a_streamed_required_call_validates_once_reassembled(client: openai.OpenAI) -> None:
    stream = forced(client, "required", n=3, seed=12, parallel_tool_calls=False, stream=True)
    calls: dict[tuple[int, int], dict[str, str]] = {}
    finished: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault((choice.index, delta.index), {"name": "", "args": ""})
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["args"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert finished == dict.fromkeys(range(3), "tool_calls")
    assert sorted(calls) == [(index, 0) for index in range(3)]
    for call in calls.values():
        _valid(call["name"], call["args"])


def test_a_named_choice_calls_that_tool(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    completion = forced(client, named, n=4, seed=13)
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "set_alarm"
        _valid(call.function.name, call.function.arguments)


def test_a_streamed_named_call_cut_short_streams_no_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        max_tokens=4,
        stream=True,
    )
    finishes = []
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            assert not choice.delta.tool_calls
            finishes.append(choice.finish_reason)
    assert finishes[-1] == "length"
