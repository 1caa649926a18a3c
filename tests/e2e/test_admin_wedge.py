"""A sleep over a keep pause with a stream in flight no longer wedges the admin plane.

Against a real ``penstock serve --engine sample``: a stream is generating, the trainer
pauses in mode ``keep`` (the stream freezes mid-generation) and sleeps through one of the
dialects. Every later admin call answers well within the client timeout with the status
the state calls for, and after wake-up and resume the frozen stream, the requests that
arrived meanwhile and new ones are all served.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
# At 0.03 s a token, a stream outlasts the few admin calls that freeze it by seconds.
MAX_TOKENS = 100
ADMIN_TIMEOUT_S = 5.0
# Far above the admin timeout: a call that takes this long is hanging.
CLIENT_TIMEOUT_S = 4 * ADMIN_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--engine",
        "sample",
        "--admin-timeout-s",
        str(ADMIN_TIMEOUT_S),
        "--",
        "--delay",
        "0.03",
    ]
    with running_server(args, tmp_path_factory.mktemp("admin-wedge")) as started:
        yield started


@dataclass
class Stream:
    """One streaming chat completion, read as raw SSE."""

    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finish_reasons(self) -> list[str]:
        return [
            choice["finish_reason"]
            for event in self.events
            for choice in event.get("choices", [])
            if choice.get("finish_reason") is not None
        ]

    @property
    def tokens(self) -> int:
        return sum(
            len(choice.get("token_ids") or [])
            for event in self.events
            for choice in event.get("choices", [])
        )


async def run_stream(
    client: httpx.AsyncClient, stream: Stream, prompt: str, max_tokens: int = MAX_TOKENS
) -> Stream:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                stream.done = True
                continue
            stream.events.append(json.loads(data))
            if stream.tokens:
                stream.started.set()
    return stream


def assert_ended(stream: Stream, reason: str) -> None:
    assert stream.done and stream.finish_reasons == [reason], stream.events[-1:]


def state_of(response: httpx.Response) -> str:
    return response.json()["error"]["state"]


@pytest.mark.parametrize(
    ("sleep_path", "frozen_end"),
    [
        # SGLang waits for running requests: frozen ones are not running, they stay.
        ("/release_memory_occupation", "length"),
        # vLLM's default sleep mode aborts in-flight requests, frozen ones included.
        ("/sleep", "abort"),
        ("/sleep?mode=keep", "length"),
    ],
)
async def test_sleep_over_a_keep_pause_answers_and_serves_afterwards(
    server: ServerProcess, sleep_path: str, frozen_end: str
) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        frozen = Stream()
        frozen_task = asyncio.create_task(run_stream(client, frozen, "frozen"))
        await asyncio.wait_for(frozen.started.wait(), CLIENT_TIMEOUT_S)

        assert (await client.post("/pause?mode=keep")).status_code == 200
        assert not frozen_task.done()
        assert (await client.post(sleep_path)).status_code == 200

        refused = await client.post("/resume")
        assert refused.status_code == 409 and state_of(refused) == "sleeping"
        refused = await client.post("/pause?mode=abort")
        assert refused.status_code == 409 and state_of(refused) == "sleeping"
        refused = await client.post(
            "/engine/update_weights_from_disk", json={"model_path": "/nonexistent"}
        )
        assert refused.status_code == 409 and state_of(refused) == "sleeping"
        assert (await client.post("/engine/flush_cache")).status_code == 200
        state = (await client.get("/engine/capabilities")).json()["state"]
        assert state["state"] == "sleeping" and state["mode"] == "keep"
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "sleeping"

        late = Stream()
        late_task = asyncio.create_task(run_stream(client, late, "late"))

        assert (await client.post("/wake_up")).json() == {"status": "awake"}
        assert (await client.get("/engine/capabilities")).json()["state"]["state"] == "paused"
        assert (await client.post("/resume")).json() == {"status": "resumed"}
        await asyncio.wait_for(asyncio.gather(frozen_task, late_task), CLIENT_TIMEOUT_S)

        assert_ended(frozen, frozen_end)
        if frozen_end == "length":
            assert frozen.tokens == MAX_TOKENS
        assert_ended(late, "length")
        assert late.tokens == MAX_TOKENS

        after = await run_stream(client, Stream(), "after", max_tokens=3)
        assert_ended(after, "length")
        assert (await client.get("/health")).status_code == 200
