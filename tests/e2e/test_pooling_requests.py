"""``/v1/embeddings``, ``/classify`` and ``/pooling`` are served as chat is: counted in the
frontend families, held to the request's deadline, and aborted in the engine past it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import running_server

MODEL = "sample-model"
# Each engine request takes this long; the server's own deadline is longer.
POOL_DELAY = "0.5"
ROUTES = [
    ("/v1/embeddings", "embeddings"),
    ("/classify", "classify"),
    ("/pooling", "pooling"),
]


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pooling-engine") / "engine.txt"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def client(marker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    args = ["--engine", "tests.support.pooling_double:SlowPoolingEngine"]
    args += ["--request-timeout-s", "5", "--"]
    args += ["--pool-delay", POOL_DELAY, "--marker", str(marker)]
    with running_server(args, tmp_path_factory.mktemp("pooling")) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            yield http


def _counted(client: httpx.Client, endpoint: str) -> dict[tuple[str, str], float]:
    """``penstock_frontend_requests_total`` of ``endpoint``, by status and error type."""
    counted: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "penstock_frontend_requests_total" and labels["endpoint"] == endpoint:
                assert labels["request_type"] == "unary"
                counted[(labels["status"], labels["error_type"])] = sample.value
    return counted


def _durations(client: httpx.Client) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if (
                sample.name == "penstock_frontend_request_duration_seconds_count"
                and sample.labels.get("model") == MODEL
            ):
                return sample.value
    return 0.0


@pytest.mark.parametrize(("path", "endpoint"), ROUTES)
def test_a_pooling_request_is_counted_in_metrics(
    client: httpx.Client, path: str, endpoint: str
) -> None:
    before, timed = _counted(client, endpoint), _durations(client)
    response = client.post(path, json={"model": MODEL, "input": ["hello", "world"]})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    after = _counted(client, endpoint)
    assert after.get(("success", ""), 0) == before.get(("success", ""), 0) + 1
    assert _durations(client) == timed + 1


@pytest.mark.parametrize(("path", "endpoint"), ROUTES)
def test_a_pooling_request_past_its_deadline_gets_408_and_one_abort(
    client: httpx.Client, marker: Path, path: str, endpoint: str
) -> None:
    request_id = f"late-{endpoint}"
    response = client.post(
        path,
        json={"model": MODEL, "input": "hello"},
        headers={"X-Request-Timeout": "0.1", "X-Request-Id": request_id},
    )
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert error["code"] == "request_timeout"
    assert error["param"] == "X-Request-Timeout"
    assert _counted(client, endpoint).get(("error", "response_timeout")) == 1
    settle = time.monotonic() + 5
    while f"abort {request_id}" not in marker.read_text() and time.monotonic() < settle:
        time.sleep(0.02)
    assert marker.read_text().splitlines().count(f"abort {request_id}") == 1


def test_a_bad_timeout_header_is_a_400_naming_it(client: httpx.Client) -> None:
    response = client.post(
        "/v1/embeddings",
        json={"model": MODEL, "input": "hello"},
        headers={"X-Request-Timeout": "soon"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Request-Timeout"
