"""The Responses API against a real server, through the official client and raw HTTP.

The engine answers every request with one fixed text holding a hermes tool call: without
tools it is plain output text, with a function tool it becomes a ``function_call`` item.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.openai_spec import spec_errors, stream_event_schema
from tests.support.server import ServerProcess, running_server

REPLY = 'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
KEY_A, KEY_B, ADMIN = "key-a", "key-b", "admin-key"
REASONING_ITEM = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x" * 2**21}]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-cache")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Iterator[ServerProcess]:
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--tool-call-parser", "hermes"]
    args += ["--cache-dir", str(cache), "--api-key", KEY_A, "--api-key", KEY_B]
    args += ["--admin-api-key", ADMIN, "--", "--reply", REPLY]
    with running_server(args, tmp_path_factory.mktemp("responses")) as process:
        yield process


def client_for(server: ServerProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return client_for(server)


def raw(server: ServerProcess, key: str = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def sse_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, name = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_create_answers_a_response_object_the_spec_and_the_client_accept(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    answer = raw(server).post(
        "/v1/responses", json={"model": "sample-model", "input": "Weather in Paris?"}
    )
    assert answer.status_code == 200, answer.text
    assert spec_errors("Response", answer.json()) == []
    response = client.responses.create(model="sample-model", input="Weather in Paris?")
    assert response.status == "completed"
    assert response.output_text == REPLY
    assert response.output[0].type == "message"
    assert response.usage is not None
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def prompt_tokens(server: ServerProcess, messages: list[dict[str, Any]]) -> int:
    """How many tokens the chat route's template makes of ``messages``."""
    answer = raw(server).post("/tokenize", json={"model": "sample-model", "messages": messages})
    assert answer.status_code == 200, answer.text
    count: int = answer.json()["count"]
    return count


def test_instructions_and_items_are_the_chat_prompt(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    instructed = client.responses.create(
        model="sample-model", input="Hi", instructions="Answer in French, briefly."
    )
    assert instructed.usage is not None
    assert instructed.usage.input_tokens == prompt_tokens(
        server,
        [
            {"role": "system", "content": "Answer in French, briefly."},
            {"role": "user", "content": "Hi"},
        ],
    )
    items = client.responses.create(
        model="sample-model",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
    )
    assert items.usage is not None
    assert items.usage.input_tokens == prompt_tokens(
        server,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Hi"},
        ],
    )


def test_function_call_items_are_the_assistant_turn_and_its_tool_messages(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    calls = [("call_1", '{"city": "Paris"}'), ("call_2", '{"city": "Rome"}')]
    response = client.responses.create(
        model="sample-model",
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Looking."},
            *[
                {"type": "function_call", "call_id": c, "name": "get_weather", "arguments": a}
                for c, a in calls
            ],
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        ],
    )
    assert response.usage is not None
    tool_calls = [
        {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for c, a in calls
    ]
    assert response.usage.input_tokens == prompt_tokens(
        server,
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": tool_calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        ],
    )


def test_previous_response_id_continues_the_stored_conversation(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model="sample-model", input="Weather?", instructions="Be brief."
    )
    follow_up = client.responses.create(
        model="sample-model", input="Thanks", previous_response_id=first.id
    )
    assert follow_up.previous_response_id == first.id
    assert follow_up.usage is not None
    # Instructions are not carried over, as OpenAI does.
    assert follow_up.usage.input_tokens == prompt_tokens(
        server,
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "Thanks"},
        ],
    )


def test_stream_events_follow_the_spec_and_rebuild_the_answer(server: ServerProcess) -> None:
    body = {"model": "sample-model", "input": "Weather?", "stream": True}
    with raw(server).stream("POST", "/v1/responses", json=body) as answer:
        assert answer.status_code == 200
        events = sse_events(answer)
    for name, event in events:
        assert name == event["type"]
        assert spec_errors(stream_event_schema(event["type"]), event) == [], event
    kinds = [event["type"] for _, event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event["sequence_number"] for _, event in events] == list(range(len(events)))
    text = "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")
    assert text == REPLY
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == REPLY


def test_the_client_stream_helper_gets_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="sample-model", input="Weather?") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == REPLY
    assert final.output_text == REPLY
    assert client.responses.retrieve(final.id).output_text == REPLY


def test_function_tools_give_function_call_items_and_their_output_continues(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(model="sample-model", input="Weather?", tools=[TOOL])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert first.output[0].type == "message"
    assert first.output_text == "On it. "
    follow_up = client.responses.create(
        model="sample-model",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[TOOL],
    )
    alone = client.responses.create(
        model="sample-model",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[TOOL],
    )
    assert follow_up.usage and alone.usage
    # The stored conversation (the question, the answer and its call) comes first.
    assert follow_up.usage.input_tokens > alone.usage.input_tokens


def test_streamed_function_calls_rebuild_in_the_client(client: openai.OpenAI) -> None:
    with client.responses.stream(model="sample-model", input="Weather?", tools=[TOOL]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_stored_responses_are_retrieved_listed_and_deleted(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    answer = client.responses.with_raw_response.create(model="sample-model", input="Keep this")
    created = answer.parse()
    fetched = raw(server).get(f"/v1/responses/{created.id}")
    assert fetched.status_code == 200
    assert fetched.json() == answer.http_response.json()
    items = client.responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model="sample-model", input="Forget this", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_belong_to_the_key_that_made_them(server: ServerProcess) -> None:
    mine = client_for(server, KEY_A).responses.create(model="sample-model", input="Mine")
    other = client_for(server, KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(model="sample-model", input="Go on", previous_response_id=mine.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert raw(server, KEY_B).delete(f"/v1/responses/{mine.id}").status_code == 404
    assert client_for(server, ADMIN).responses.retrieve(mine.id).id == mine.id


def test_stored_responses_outlive_the_server(
    tmp_path: Path, cache: Path, server: ServerProcess
) -> None:
    created = client_for(server).responses.create(model="sample-model", input="Durable")
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--cache-dir", str(cache)]
    args += ["--api-key", KEY_A, "--", "--reply", REPLY]
    with running_server(args, tmp_path) as second:
        assert client_for(second).responses.retrieve(created.id).output_text == REPLY


@pytest.fixture(scope="module")
def sample_server(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Iterator[ServerProcess]:
    """The sample engine: it writes until ``max_output_tokens``."""
    args = ["--engine", "sample", "--cache-dir", str(cache), "--", "--delay", "0"]
    with running_server(args, tmp_path_factory.mktemp("sample")) as process:
        yield process


def test_max_output_tokens_cuts_the_response_incomplete(sample_server: ServerProcess) -> None:
    server, client = sample_server, client_for(sample_server)
    cut = client.responses.create(model="sample-model", input="Hi", max_output_tokens=3)
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3
    body = {"model": "sample-model", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with raw(server).stream("POST", "/v1/responses", json=body) as answer:
        events = sse_events(answer)
    assert events[-1][1]["type"] == "response.incomplete"
    assert spec_errors("ResponseIncompleteEvent", events[-1][1]) == []


@pytest.fixture(scope="module")
def capable_server(
    tmp_path_factory: pytest.TempPathFactory, cache: Path
) -> Iterator[ServerProcess]:
    """An engine that honours output constraints and answers with what it was handed."""
    args = ["--engine", "tests.support.doubles:CapableEngine", "--cache-dir", str(cache)]
    with running_server(args, tmp_path_factory.mktemp("capable")) as process:
        yield process


def test_text_format_reaches_the_engine_as_its_constraint(
    capable_server: ServerProcess,
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    response = client_for(capable_server).responses.create(
        model="sample-model",
        input="Where?",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    handed = json.loads(response.output_text)["guided_decoding"]
    assert handed["json"] == schema
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_sampling_extensions_pass_through(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="sample-model", input="Hi", extra_body={"top_k": 5, "seed": 1}
    )
    assert response.output_text == REPLY


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]", "function_call_output"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({"input": "Hi", "max_output_tokens": 10**9}, "max_tokens", "context"),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
            "required",
        ),
        ({"input": "Hi", "previous_response_id": "resp_missing"}, "previous_response_id", "not"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            "response_format",
            "response_format",
        ),
        ({"input": "Hi", "tools": [TOOL], "tool_choice": "required"}, "tool_choice", "constrain"),
        ({"input": "Hi", "no_such_field": 1}, "no_such_field", "Unknown"),
        ({"input": "Hi", "n": 2}, "n", "not a Responses API"),
        ({"input": "Hi", "top_k": "many"}, "top_k", "integer"),
        # OpenAI's bounds on metadata: 16 pairs, 64-character keys, 512-character values.
        ({"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
        ({"input": "Hi", "metadata": {"k" * 65: "v"}}, "metadata", "64 characters"),
        ({"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata.k", "512 characters"),
        # Reasoning items are stored, not rendered: no longer than a prompt could be.
        ({"input": [REASONING_ITEM, {"role": "user", "content": "Hi"}]}, "input", "context"),
        (
            {"input": [{"type": "reasoning", "summary": [{"type": "note", "text": "x"}]}]},
            "input[0].summary[0].type",
            "summary_text",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, says: str
) -> None:
    answer = raw(server).post("/v1/responses", json={"model": "sample-model", **body})
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert param in (error["param"] or ""), error
    assert says in error["message"], error
    # The server keeps serving.
    assert client_for(server).responses.create(model="sample-model", input="Hi").output_text


def test_metadata_at_openais_bounds_and_a_reasoning_summary_are_taken(
    server: ServerProcess,
) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Rain."}]}
    body = {"model": "sample-model", "metadata": metadata}
    body["input"] = [reasoning, {"role": "user", "content": "Hi"}]
    answer = raw(server).post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["metadata"] == metadata
    items = raw(server).get(f"/v1/responses/{answer.json()['id']}/input_items").json()["data"]
    assert [item["summary"] for item in items if item["type"] == "reasoning"] == [
        reasoning["summary"]
    ]
