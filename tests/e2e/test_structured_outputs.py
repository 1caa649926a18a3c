"""Constrained decoding against a real server on a tiny checkpoint with random weights.

Random weights write valid JSON only when the constraint holds them to it, so every
sample must validate: OpenAI's ``chat.completions.parse`` with pydantic models, vLLM's
extra-body spellings, SGLang's ``/generate`` spellings and forced tool calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.server import ServerProcess, running_server
from tests.support.tiny_llm import build_tiny_llama

MESSAGES: list[Any] = [{"role": "user", "content": "Describe something."}]
SAMPLES = 8
# A random model ends a free string only by the chance of a closing quote among its whole
# vocabulary: strings here are bounded, as a schema for it must bound them.
ShortText = Annotated[str, Field(max_length=16)]


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: ShortText
    age: int
    tall: bool


class Paint(BaseModel):
    colour: Colour
    coats: int = Field(ge=1, le=5)
    shades: list[float] = Field(max_length=3)


class Address(BaseModel):
    street: ShortText
    number: int | None


class Letter(BaseModel):
    to: Address
    lines: list[ShortText] = Field(min_length=1, max_length=2)


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer"},
            },
            "required": ["city", "days"],
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    args = ["--engine", "transformers", "--model", str(model_dir), "--tool-call-parser", "hermes"]
    args += ["--", "--served-model-name", "tiny", "--cpu-threads", "1", "--max-num-seqs", "8"]
    with running_server(
        args, tmp_path_factory.mktemp("serve"), env={"HF_HUB_OFFLINE": "1"}, ready_timeout=120
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("model", [Person, Paint, Letter])
def test_parse_with_a_pydantic_model_always_validates(
    client: openai.OpenAI, model: type[BaseModel]
) -> None:
    completion = client.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        response_format=model,
        n=SAMPLES,
        max_tokens=300,
        seed=1,
    )
    assert len(completion.choices) == SAMPLES
    for choice in completion.choices:
        # Stopped by the grammar's end, not by the token limit.
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model)
        # Compact separators: no whitespace outside strings beyond ", " and ": ".
        assert "\n" not in json.dumps(json.loads(choice.message.content or ""))


def test_a_streamed_answer_validates_once_reassembled(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "paint", "schema": Paint.model_json_schema(), "strict": True},
        },
        n=4,
        max_tokens=300,
        stream=True,
    )
    texts = ["", "", "", ""]
    finished = [None] * 4
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert finished == ["stop"] * 4
    for text in texts:
        Paint.model_validate_json(text)


@pytest.mark.parametrize(
    "extra",
    [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}],
)
def test_json_object_is_one_json_object(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=SAMPLES, max_tokens=300, seed=2, extra_body=extra
    )
    # Any object allows free strings, which a random model may not close within the limit;
    # every answer the grammar ended is one object, and its tokens stop there.
    ended = [c for c in completion.choices if c.finish_reason == "stop"]
    assert ended
    for choice in ended:
        assert isinstance(json.loads(choice.message.content or ""), dict), choice.message.content


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}


def _check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _check_regex(text: str) -> None:
    assert re.fullmatch(r"[a-c]{2}-\d{1,3}", text), text


def _check_choice(text: str) -> None:
    assert text in ("yes", "no", "maybe"), text


def _check_grammar(text: str) -> None:
    assert re.fullmatch(r"(ping|pong)( (ping|pong)){0,4}", text), text


GRAMMAR = 'root ::= word (" " word){0,4}\nword ::= "ping" | "pong"'
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<answer>", "schema": SCHEMA, "end": "</answer>"}],
    "triggers": ["<answer>"],
}


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_json": SCHEMA}, _check_json),
        ({"guided_regex": r"[a-c]{2}-\d{1,3}"}, _check_regex),
        ({"guided_choice": ["yes", "no", "maybe"]}, _check_choice),
        ({"guided_grammar": GRAMMAR}, _check_grammar),
        ({"structured_outputs": {"json": SCHEMA}}, _check_json),
        ({"structured_outputs": {"regex": r"[a-c]{2}-\d{1,3}"}}, _check_regex),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, _check_choice),
        ({"structured_outputs": {"grammar": GRAMMAR}}, _check_grammar),
    ],
)
def test_vllm_spellings_constrain_chat_and_completions(
    client: openai.OpenAI, extra: dict[str, Any], check: Any
) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=4, max_tokens=120, seed=3, extra_body=extra
    )
    texts = [choice.message.content or "" for choice in chat.choices]
    completion = client.completions.create(
        model="tiny", prompt="Say:", n=4, max_tokens=120, seed=3, extra_body=extra
    )
    texts += [choice.text for choice in completion.choices]
    for text in texts:
        check(text)


def test_a_structural_tag_holds_the_tagged_part(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=4,
        max_tokens=200,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(TAG)}},
    )
    for choice in chat.choices:
        text = choice.message.content or ""
        for inside in re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL):
            _check_json(inside)


@pytest.mark.parametrize(
    ("params", "check"),
    [
        ({"json_schema": json.dumps(SCHEMA)}, _check_json),
        ({"regex": r"[a-c]{2}-\d{1,3}"}, _check_regex),
        ({"ebnf": GRAMMAR}, _check_grammar),
    ],
)
def test_sglang_generate_spellings(
    server: ServerProcess, params: dict[str, Any], check: Any
) -> None:
    for seed in range(4):
        body = {
            "text": "Say:",
            "sampling_params": {**params, "max_new_tokens": 120, "sampling_seed": seed},
        }
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        check(response.json()["text"])


# A schema nested deeper than the engine compiles.
DEEP_SCHEMA: dict[str, Any] = {"type": "object"}
for _ in range(40):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}


def _arguments_valid(call: Any, tools: list[dict[str, Any]]) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_always_calls_with_valid_arguments(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        n=SAMPLES,
        max_tokens=250,
        seed=4,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        _arguments_valid(calls[0], tools)


def test_parallel_required_calls_each_validate(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        n=4,
        max_tokens=400,
        seed=6,
    )
    # Each block may be followed by another, so a random model may run to the limit: the
    # answers the grammar ended are read as calls, the others' complete blocks are calls
    # all the same.
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for choice in completion.choices:
        if choice.finish_reason == "tool_calls":
            calls = choice.message.tool_calls or []
            assert calls and not choice.message.content
            blocks = [(call.function.name, call.function.arguments) for call in calls]
        else:
            assert choice.finish_reason == "length"
            content = choice.message.content or ""
            texts = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", content, re.DOTALL)
            blocks = [
                (json.loads(t)["name"], json.dumps(json.loads(t)["arguments"])) for t in texts
            ]
        assert blocks, choice.message.content
        for name, arguments in blocks:
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_named_tool_choice_calls_that_tool_once(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=SAMPLES,
        max_tokens=250,
        seed=5,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = choice.message.tool_calls or []
        assert [call.function.name for call in calls] == ["get_time"], choice.message.content
        _arguments_valid(calls[0], tools)


@pytest.mark.parametrize(
    ("extra", "param", "reason"),
    [
        ({"guided_regex": "(("}, "guided_decoding.regex", "not supported"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "guided_decoding.json",
            "not supported",
        ),
        ({"guided_json": DEEP_SCHEMA}, "guided_decoding.json", "deep"),
        ({"guided_choice": []}, "guided_decoding.choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [TIME_TOOL],
            },
            "tool_choice",
            "'nope'",
        ),
    ],
)
def test_a_constraint_it_cannot_follow_is_a_400_before_any_token(
    client: openai.OpenAI, extra: dict[str, Any], param: str, reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=10, extra_body=extra
        )
    error = refused.value.body
    assert isinstance(error, dict), error
    assert param in (error.get("param") or "") + error["message"], error
    assert reason in error["message"], error
    # The server keeps serving.
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
