"""Where a real ``penstock serve`` keeps media: a file as ``--media-store`` stops startup
in one line, and an in-memory store keeps its jobs in memory too."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.server import REPO_ROOT, running_server


def serve_sample(*args: str) -> subprocess.CompletedProcess[str]:
    """``penstock serve --engine sample *args``, expected to stop at startup."""
    command = [sys.executable, "-m", "penstock", "serve", "--engine", "sample", "--port", "0"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )


def test_a_file_as_media_store_fails_at_startup_in_one_line(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "store.txt"
    not_a_folder.write_text("not a folder")
    result = serve_sample("--media-store", str(not_a_folder))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"penstock: error: --media-store {not_a_folder} is a file; name a folder "
        "(created if missing) or an fsspec URL"
    ]
    assert "engine ready" not in result.stdout + result.stderr


def test_a_store_url_nothing_can_open_fails_at_startup_in_one_line() -> None:
    result = serve_sample("--media-store", "nope://bucket/media")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "penstock: error: --media-store nope://bucket/media: Protocol not known: nope"
    ]


def test_a_file_where_the_default_store_goes_fails_at_startup_in_one_line(tmp_path: Path) -> None:
    default_store = tmp_path / "media" / "sample-diffusion-model"
    default_store.parent.mkdir()
    default_store.write_text("not a folder")
    result = serve_sample("--cache-dir", str(tmp_path), "--engine", "sample-diffusion")
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"penstock: error: --media-store {default_store} is a file")
    )
    assert "Traceback" not in result.stdout + result.stderr


def test_an_in_memory_store_keeps_its_jobs_out_of_the_cache_folder(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["--engine", "sample-diffusion", "--media-store", "memory://penstock-e2e"]
    args += ["--cache-dir", str(cache), "--", "--delay", "0", "--endpoint-types", "videos"]
    with running_server(args, tmp_path) as server, httpx.Client(base_url=server.base_url) as http:
        created = http.post("/v1/videos", json={"prompt": "p", "size": "64x64", "seconds": "1"})
        video_id = created.json()["id"]
        deadline = time.monotonic() + 20
        while http.get(f"/v1/videos/{video_id}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.get(f"/v1/videos/{video_id}/content").status_code == 200
        assert "video jobs kept in memory, generated media in memory://penstock-e2e" in (
            server.log()
        )
    assert list(tmp_path.rglob("*.sqlite3*")) == []
