"""Gateways sharing one job database (PostgreSQL) and one media folder, as real
``penstock serve`` processes: a job made through one is polled, listed and downloaded
through another, under the same key scoping; queued jobs outlive a gateway killed with
SIGKILL, and its running job ends failed with the reason."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.postgres import fresh_database, running_postgres
from tests.support.server import REPO_ROOT, ServerProcess, free_port, running_server

KEY_A, KEY_B = "sk-shared-a", "sk-shared-b"
LEASE_S = 1.5
VIDEO = {"prompt": "a red ball", "size": "64x64", "seconds": "1"}


@dataclass
class Fleet:
    db: str
    store: Path
    logs: Path
    first: ServerProcess
    second: ServerProcess

    def gateway(self, *engine_args: str) -> Any:
        """Another gateway on the same database and folder."""
        args = ["--engine", "sample-diffusion", "--media-store", str(self.store)]
        args += ["--media-db", self.db, "--media-job-lease-s", str(LEASE_S)]
        args += ["--api-key", KEY_A, "--api-key", KEY_B, "--"]
        args += ["--endpoint-types", "images,videos", *engine_args]
        return running_server(args, self.logs)


def client(server: ServerProcess, key: str = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def wait_for(http: httpx.Client, video_id: str, status: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        video = http.get(f"/v1/videos/{video_id}").json()
        if video["status"] == status:
            return video
        assert time.monotonic() < deadline, video
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("shared-jobs")
    with running_postgres() as server_url:
        shared = Fleet(fresh_database(server_url), root / "media", root, None, None)  # type: ignore[arg-type]
        with shared.gateway("--delay", "0.2") as first, shared.gateway("--delay", "0.2") as second:
            shared.first, shared.second = first, second
            yield shared


def test_a_video_made_through_one_gateway_is_polled_and_downloaded_through_another(
    fleet: Fleet,
) -> None:
    with client(fleet.first) as one, client(fleet.second) as other:
        video_id = one.post("/v1/videos", json=VIDEO).json()["id"]
        done = wait_for(other, video_id, "completed")
        assert done["progress"] == 100
        content = other.get(f"/v1/videos/{video_id}/content")
        assert content.status_code == 200 and content.content
        assert content.content == one.get(f"/v1/videos/{video_id}/content").content
        ranged = other.get(f"/v1/videos/{video_id}/content", headers={"Range": "bytes=0-3"})
        assert ranged.status_code == 206 and ranged.content == content.content[:4]
        assert video_id in [v["id"] for v in other.get("/v1/videos").json()["data"]]
        assert other.delete(f"/v1/videos/{video_id}").status_code == 200
        assert one.get(f"/v1/videos/{video_id}").status_code == 404


def test_another_key_sees_nothing_on_any_gateway(fleet: Fleet) -> None:
    with client(fleet.first) as mine, client(fleet.second, KEY_B) as theirs:
        video_id = mine.post("/v1/videos", json=VIDEO).json()["id"]
        assert theirs.get(f"/v1/videos/{video_id}").status_code == 404
        assert video_id not in [v["id"] for v in theirs.get("/v1/videos").json()["data"]]
        image = mine.post("/v1/images/generations", json={"prompt": "a dot", "size": "64x64"})
        url = httpx.URL(image.json()["data"][0]["url"])
        assert theirs.get(url.path).status_code == 404
        with client(fleet.second) as mine_elsewhere:
            assert mine_elsewhere.get(url.path).headers["content-type"] == "image/png"
            wait_for(mine_elsewhere, video_id, "completed")


def test_a_job_deleted_elsewhere_stops_and_queued_jobs_outlive_a_killed_gateway(
    fleet: Fleet,
) -> None:
    with fleet.gateway("--delay", "60", "--steps", "60") as doomed, client(doomed) as http:
        deleted, running, queued = (http.post("/v1/videos", json=VIDEO).json()["id"] for _ in "abc")
        with client(fleet.second) as survivor:
            wait_for(survivor, deleted, "in_progress")
            assert survivor.get(f"/v1/videos/{queued}").json()["queue_position"] == 2
            assert survivor.delete(f"/v1/videos/{deleted}").status_code == 200
            # Its runner stops it at the next beat, long before its minute is up.
            wait_for(survivor, running, "in_progress", timeout=LEASE_S * 10)
            assert survivor.get(f"/v1/videos/{queued}").json()["queue_position"] == 1
            doomed.stop(9)
            failed = wait_for(survivor, running, "failed", timeout=LEASE_S * 10)
            assert failed["error"]["code"] == "interrupted"
            assert "the server stopped" in failed["error"]["message"]
            wait_for(survivor, queued, "completed", timeout=LEASE_S * 10)
            assert survivor.get(f"/v1/videos/{queued}/content").status_code == 200


def test_a_job_database_that_cannot_be_reached_stops_startup_in_one_line() -> None:
    url = f"postgresql+psycopg://penstock:hunter2@127.0.0.1:{free_port()}/jobs"
    command = [sys.executable, "-m", "penstock", "serve", "--engine", "sample", "--port", "0"]
    result = subprocess.run(
        [*command, "--media-db", url], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "penstock: error: --media-db postgresql+psycopg://penstock:***@127.0.0.1:"
    )
    assert "cannot open the job database" in line and "hunter2" not in result.stdout + line
    assert "engine ready" not in result.stdout + result.stderr
