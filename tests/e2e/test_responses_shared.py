"""Stored responses in a PostgreSQL job database that two text gateways share, and what a
gateway answers while that database hangs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.postgres import PostgresServer, fresh_database, postgres_server
from tests.support.server import ServerProcess, running_server

REPLY = "Shared answer."
KEY_A, KEY_B = "key-a", "key-b"
# What "answers at once" means here: far below the store's 5 s call bound.
PROMPT_S = 2.0


@pytest.fixture(scope="module")
def database() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@contextlib.contextmanager
def gateways(db_url: str, root: Path, count: int) -> Iterator[list[ServerProcess]]:
    args = ["--engine", "tests.support.doubles:ReplyEngine", "--media-db", db_url]
    args += ["--api-key", KEY_A, "--api-key", KEY_B, "--", "--reply", REPLY]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(args, root)) for _ in range(count)]


def client(server: ServerProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_a_conversation_started_on_one_gateway_continues_on_another(
    database: PostgresServer, tmp_path: Path
) -> None:
    with gateways(fresh_database(database.url), tmp_path, 2) as (first, second):
        started = client(first).responses.create(model="sample-model", input="Hello")
        continued = client(second).responses.create(
            model="sample-model", input="Go on", previous_response_id=started.id
        )
        assert continued.output_text == REPLY
        assert client(first).responses.retrieve(continued.id).previous_response_id == started.id
        with pytest.raises(openai.NotFoundError):
            client(second, KEY_B).responses.retrieve(started.id)
        client(second).responses.delete(started.id)
        with pytest.raises(openai.NotFoundError):
            client(first).responses.retrieve(started.id)


def test_a_hung_database_answers_503_and_leaves_the_rest_serving(
    database: PostgresServer, tmp_path: Path
) -> None:
    with gateways(fresh_database(database.url), tmp_path, 1) as (server,):
        kept = client(server).responses.create(model="sample-model", input="Before")
        headers = {"Authorization": f"Bearer {KEY_A}"}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=15) as http:
            with database.paused():
                refused = http.get(f"/v1/responses/{kept.id}")
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["retry-after"]) > 0
                assert refused.json()["error"]["code"] == "job_store_unavailable"
                assert "response store" in refused.json()["error"]["message"]
                body = {"model": "sample-model", "input": "Not kept", "store": False}
                unstored = http.post("/v1/responses", json=body, timeout=PROMPT_S)
                assert unstored.status_code == 200, unstored.text
                assert http.get("/live", timeout=PROMPT_S).status_code == 200
                # A stream whose response can't be stored ends with the error, not with
                # response.completed: no client is told a response is kept that is not.
                body = {"model": "sample-model", "input": "Kept?", "stream": True}
                with http.stream("POST", "/v1/responses", json=body) as streamed:
                    lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == (
                    "job_store_unavailable"
                )
                assert not any("response.completed" in line for line in lines)
            assert (
                http.get(f"/v1/responses/{kept.id}").json()["output"][0]["content"][0]["text"]
                == REPLY
            )
