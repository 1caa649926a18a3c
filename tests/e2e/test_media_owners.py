"""Media jobs and images belong to the key that created them (``--api-key`` x2).

Against a real ``penstock serve --engine sample-diffusion`` serving images and videos:
another key gets 404 for everything of someone else's (not 403: existence stays
hidden), an admin key sees everything, the job database stores no key, and a database
from before owners were recorded keeps its jobs visible.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, running_server

ALICE, BOB, ROOT = "alice-key-0123456789", "bob-key-0123456789", "root-key-0123456789"
LEGACY_ID = "video_legacy0000000000000000000000"
LEGACY_BYTES = b"legacy video bytes"

# The job table as it was before the owner column.
_LEGACY_SCHEMA = """
CREATE TABLE video_jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL,
    prompt TEXT NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL, completed_at INTEGER, seconds TEXT NOT NULL,
    size TEXT NOT NULL, error_code TEXT, error_message TEXT, artifact TEXT,
    content_type TEXT, inference_time_s REAL, request TEXT NOT NULL
)
"""


def legacy_store(store: Path) -> None:
    (store / "videos").mkdir(parents=True)
    (store / "videos" / f"{LEGACY_ID}.mp4").write_bytes(LEGACY_BYTES)
    with sqlite3.connect(store / "jobs.sqlite3") as db:
        db.execute(_LEGACY_SCHEMA)
        db.execute(
            "INSERT INTO video_jobs (id, model, prompt, status, progress, created_at, "
            "completed_at, seconds, size, artifact, content_type, request) "
            "VALUES (?, 'sample-diffusion-model', 'an old job', 'completed', 100, 1, 2, '1', "
            "'64x64', ?, 'video/mp4', ?)",
            (LEGACY_ID, f"videos/{LEGACY_ID}.mp4", json.dumps({})),
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("owners")
    legacy_store(root / "store")
    args = ["--engine", "sample-diffusion", "--media-store", str(root / "store")]
    args += ["--api-key", ALICE, "--api-key", BOB, "--admin-api-key", ROOT]
    args += ["--", "--delay", "0", "--endpoint-types", "images,videos"]
    with running_server(args, root) as process:
        yield process


def client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def finished_video(http: httpx.Client, prompt: str) -> str:
    created = http.post("/v1/videos", json={"prompt": prompt, "size": "64x64", "seconds": "1"})
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    deadline = time.monotonic() + 20
    while http.get(f"/v1/videos/{video_id}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return video_id


def listed(http: httpx.Client) -> dict[str, str]:
    page = http.get("/v1/videos", params={"limit": 100}).json()
    return {item["id"]: item["prompt"] for item in page["data"]}


def test_another_keys_videos_are_not_found_and_the_admin_sees_all(server: ServerProcess) -> None:
    with client(server, ALICE) as alice, client(server, BOB) as bob, client(server, ROOT) as root:
        mine = finished_video(alice, "alice's secret prompt")
        theirs = finished_video(bob, "bob's prompt")
        assert alice.get(f"/v1/videos/{mine}/content").status_code == 200
        assert mine in listed(alice) and theirs not in listed(alice)
        assert "alice's secret prompt" not in listed(bob).values()
        for method, path in (
            ("GET", f"/v1/videos/{mine}"),
            ("GET", f"/v1/videos/{mine}/content"),
            ("DELETE", f"/v1/videos/{mine}"),
        ):
            refused = bob.request(method, path)
            assert refused.status_code == 404, (method, path)
            assert refused.json()["error"]["code"] == "video_not_found"
        cursor = bob.get("/v1/videos", params={"after": mine})
        assert cursor.status_code == 400 and cursor.json()["error"]["param"] == "after"
        assert {mine, theirs} <= set(listed(root))
        assert root.get(f"/v1/videos/{theirs}/content").status_code == 200
        assert root.delete(f"/v1/videos/{theirs}").status_code == 200
        assert bob.get(f"/v1/videos/{theirs}").status_code == 404
        assert alice.get(f"/v1/videos/{mine}").json()["status"] == "completed"


def test_another_keys_images_are_not_found(server: ServerProcess) -> None:
    with client(server, ALICE) as alice, client(server, BOB) as bob, client(server, ROOT) as root:
        made = alice.post("/v1/images/generations", json={"prompt": "a cat"})
        assert made.status_code == 200, made.text
        url = made.json()["data"][0]["url"]
        assert alice.get(url).status_code == 200
        refused = bob.get(url)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "image_not_found"
        assert root.get(url).status_code == 200


def test_jobs_from_before_owners_were_recorded_keep_working(server: ServerProcess) -> None:
    with client(server, ALICE) as alice, client(server, BOB) as bob:
        for http in (alice, bob):
            assert listed(http).get(LEGACY_ID) == "an old job"
            assert http.get(f"/v1/videos/{LEGACY_ID}/content").content == LEGACY_BYTES


def test_the_job_database_holds_no_key(server: ServerProcess) -> None:
    store = Path(server.log_path).parent / "store"
    stored = b"".join(path.read_bytes() for path in store.glob("jobs.sqlite3*"))
    assert b"alice's secret prompt" in stored or b"bob's prompt" in stored
    for key in (ALICE, BOB, ROOT):
        assert key.encode() not in stored
