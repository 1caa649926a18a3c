"""Real ``penstock serve`` gateways whose job database (PostgreSQL) goes away under them:
stopped and started again, or hung with SIGSTOP. The gateway keeps answering everything
that needs no job store, job routes answer 503 with ``Retry-After``, and no job is lost
or failed for an outage: each run that ended is stored once the database is back."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.postgres import PostgresServer, fresh_database, postgres_server
from tests.support.server import ServerProcess, running_server

LEASE_S = 1.5
VIDEO = {"prompt": "a red ball", "size": "64x64", "seconds": "1"}
# What "answers at once" means here: far below the outages the tests make, and a bound
# a loaded machine still keeps.
PROMPT_S = 2.0


@pytest.fixture(scope="module")
def database() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


def gateway(db_url: str, root: Path, *engine_args: str) -> Any:
    args = ["--engine", "sample-diffusion", "--media-store", str(root / "media")]
    args += ["--media-db", db_url, "--media-job-lease-s", str(LEASE_S), "--"]
    args += ["--endpoint-types", "images,videos", *engine_args]
    return running_server(args, root)


def client(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=30)


def wait_until(http: httpx.Client, video_id: str, done: Callable[[dict], bool]) -> dict:
    deadline = time.monotonic() + 60
    while True:
        video = http.get(f"/v1/videos/{video_id}").json()
        if done(video):
            return video
        assert time.monotonic() < deadline, video
        time.sleep(0.05)


def running_generations(http: httpx.Client) -> float:
    text = http.get("/metrics", timeout=PROMPT_S).text
    match = re.search(r"^penstock_media_running_generations (\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


def assert_refused_for_the_store(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) > 0
    error = response.json()["error"]
    assert error["code"] == "job_store_unavailable"
    assert error["type"] == "service_unavailable"
    assert "job database" in error["message"]


def test_a_hung_database_leaves_the_gateway_answering(
    database: PostgresServer, tmp_path: Path
) -> None:
    with gateway(fresh_database(database.url), tmp_path) as server, client(server) as http:
        video_id = http.post("/v1/videos", json=VIDEO).json()["id"]
        wait_until(http, video_id, lambda video: video["status"] == "completed")
        with database.paused():
            # Long enough for the gateway's beat to have called the hung server.
            time.sleep(LEASE_S)
            for path in ("/live", "/health", "/v1/models"):
                assert http.get(path, timeout=PROMPT_S).status_code == 200, path
            assert running_generations(http) == 0
            image = {"prompt": "a dot", "size": "64x64", "response_format": "b64_json"}
            made = http.post("/v1/images/generations", json=image, timeout=PROMPT_S)
            assert made.status_code == 200 and made.json()["data"][0]["b64_json"]
            assert_refused_for_the_store(http.get(f"/v1/videos/{video_id}", timeout=15))
            assert_refused_for_the_store(http.post("/v1/videos", json=VIDEO, timeout=15))
            assert http.get("/live", timeout=PROMPT_S).status_code == 200
        assert http.get(f"/v1/videos/{video_id}").json()["status"] == "completed"
        listed = http.get("/v1/videos").json()["data"]
        assert [video["id"] for video in listed] == [video_id]
        with database.paused():
            # Calls stuck on the hung server keep no stopped gateway from exiting.
            server.stop(timeout=30)


def test_a_job_running_through_an_outage_is_stored_completed(
    database: PostgresServer, tmp_path: Path
) -> None:
    slow = ("--delay", "6", "--steps", "12")
    with gateway(fresh_database(database.url), tmp_path, *slow) as server, client(server) as http:
        video_id = http.post("/v1/videos", json=VIDEO).json()["id"]
        wait_until(http, video_id, lambda video: video["progress"] > 0)
        database.stop()
        try:
            assert_refused_for_the_store(http.get(f"/v1/videos/{video_id}"))
            # Its progress could not be stored; the generation goes on to its end.
            deadline = time.monotonic() + 30
            while running_generations(http):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            database.start()
        done = wait_until(http, video_id, lambda video: video["status"] != "in_progress")
        assert done["status"] == "completed" and done["progress"] == 100, done
        content = http.get(f"/v1/videos/{video_id}/content")
        assert content.status_code == 200 and content.content


def test_an_outage_longer_than_the_lease_fails_no_running_job(
    database: PostgresServer, tmp_path: Path
) -> None:
    db_url = fresh_database(database.url)
    slow = ("--delay", "6", "--steps", "12")
    with gateway(db_url, tmp_path, *slow) as first, gateway(db_url, tmp_path, *slow) as second:
        with client(first) as one, client(second) as other:
            ids = [http.post("/v1/videos", json=VIDEO).json()["id"] for http in (one, other)]
            for video_id in ids:
                wait_until(one, video_id, lambda video: video["progress"] > 0)
            database.stop()
            try:
                time.sleep(LEASE_S * 3)
            finally:
                database.start()
            for video_id in ids:
                done = wait_until(other, video_id, lambda video: video["status"] != "in_progress")
                assert done["status"] == "completed", done
