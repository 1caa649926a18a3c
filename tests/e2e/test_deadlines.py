"""Request deadlines: past one the client gets a timeout, the engine an abort, once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hello"}]
# 0.05 s a token: a request for LONG tokens takes seconds, far past every deadline here.
LONG = 200


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deadline-engine") / "engine.txt"


@pytest.fixture(scope="module")
def server(marker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--engine",
        "tests.support.doubles:AbortRecordingEngine",
        "--request-timeout-s",
        "0.6",
        "--max-request-timeout-s",
        "1.2",
        "--max-concurrency",
        "1",
        "--",
        "--marker",
        str(marker),
        "--delay",
        "0.05",
    ]
    with running_server(args, tmp_path_factory.mktemp("deadlines")) as process:
        yield process


def chat(
    client: httpx.Client, request_id: str, timeout: str | None = None, **fields: object
) -> httpx.Response:
    headers = {"X-Request-Id": request_id}
    if timeout is not None:
        headers["X-Request-Timeout"] = timeout
    body = {"model": MODEL, "messages": HELLO, "max_tokens": LONG, **fields}
    return client.post("/v1/chat/completions", json=body, headers=headers)


def aborts_of(marker: Path, request_id: str) -> int:
    """How often the engine was asked to abort ``request_id``, once aborts have settled."""
    deadline = time.monotonic() + 5
    while f"abort {request_id}" not in marker.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    return marker.read_text().splitlines().count(f"abort {request_id}")


def assert_timeout_envelope(error: dict[str, object], seconds: str) -> None:
    assert error["code"] == "request_timeout"
    assert error["type"] == "timeout_error"
    assert error["param"] == "X-Request-Timeout"
    assert f"{seconds} s deadline" in str(error["message"])


def timeouts_counted(client: httpx.Client, endpoint: str) -> dict[str, float]:
    """Requests of ``endpoint`` counted as timed out, by request type."""
    counted: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "penstock_frontend_requests_total"
                and labels["endpoint"] == endpoint
                and labels["error_type"] == "response_timeout"
            ):
                assert labels["status"] == "error"
                counted[labels["request_type"]] = sample.value
    return counted


def test_a_unary_request_past_its_deadline_gets_408_and_the_engine_one_abort(
    client: httpx.Client, marker: Path
) -> None:
    response = chat(client, "unary-late", "0.3")
    assert response.status_code == 408, response.text
    assert_timeout_envelope(response.json()["error"], "0.3")
    assert aborts_of(marker, "unary-late") == 1
    assert client.get("/health").status_code == 200
    done = chat(client, "unary-after", None, max_tokens=2)
    assert done.status_code == 200
    assert done.json()["choices"][0]["finish_reason"] == "length"


def test_a_stream_past_its_deadline_ends_with_an_error_frame_and_done(
    client: httpx.Client, marker: Path
) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": LONG, "stream": True}
    headers = {"X-Request-Id": "stream-late", "X-Request-Timeout": "0.4"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        frames = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert_timeout_envelope(error, "0.4")
    # Tokens came before the deadline: the error arrived after the first byte.
    assert any('"content"' in frame for frame in frames[:-2])
    assert aborts_of(marker, "stream-late") == 1
    assert timeouts_counted(client, "chat_completions").get("stream") == 1


def test_the_server_default_applies_without_a_header(client: httpx.Client) -> None:
    response = chat(client, "default-deadline")
    assert response.status_code == 408
    assert_timeout_envelope(response.json()["error"], "0.6")


def test_a_header_above_the_maximum_is_lowered_to_it(client: httpx.Client) -> None:
    response = chat(client, "capped-deadline", "3600")
    assert response.status_code == 408
    assert_timeout_envelope(response.json()["error"], "1.2")
    within = chat(client, "longer-deadline", "1.2", max_tokens=12)
    assert within.status_code == 200, within.text


def test_the_deadline_covers_the_admission_queue(client: httpx.Client, marker: Path) -> None:
    # One request at a time: the second waits in the queue behind the first.
    blocker = threading.Thread(target=lambda: chat(client, "blocker", "1.2", max_tokens=15))
    blocker.start()
    try:
        time.sleep(0.2)
        queued = chat(client, "queued-late", "0.2", max_tokens=2)
    finally:
        blocker.join()
    assert queued.status_code == 408
    assert_timeout_envelope(queued.json()["error"], "0.2")
    assert chat(client, "after-queue", None, max_tokens=2).status_code == 200


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf", ""])
def test_an_invalid_timeout_header_is_a_400_naming_it(client: httpx.Client, value: str) -> None:
    response = chat(client, "bad-header", value, max_tokens=1)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "X-Request-Timeout"
    assert "positive number of seconds" in error["message"]


def test_completions_have_the_same_deadline(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": LONG}
    response = client.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"})
    assert response.status_code == 408
    assert_timeout_envelope(response.json()["error"], "0.3")
    assert timeouts_counted(client, "completions") == {"unary": 1}
