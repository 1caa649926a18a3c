"""The app builds the media service from the settings and runs it once per lifespan."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from penstock.app.factory import create_app, job_db_path, media_store_location
from penstock.media.jobs import JobStore
from penstock.media.records import IN_PROGRESS, VideoJob
from penstock.media.service import INTERRUPTED_REASON, MediaService
from penstock.settings import Settings
from tests.support.inprocess import LOOPBACK_CLIENT, asgi_client, start_gateway
from tests.support.snippet import run_snippet


def left_running(db_path: Path) -> str:
    """A job a previous process was running when it stopped."""
    jobs = JobStore(db_path)
    job = VideoJob(
        id="video_left_running",
        model="sample-video",
        prompt="a red ball",
        seconds="1",
        size="64x48",
        request={"prompt": "a red ball"},
        status=IN_PROGRESS,
    )
    jobs.add(job)
    jobs.close()
    return job.id


async def test_the_lifespan_starts_and_stops_the_media_service_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    start, stop = MediaService.start, MediaService.stop

    def counted_start(service: MediaService) -> None:
        calls.append("start")
        start(service)

    async def counted_stop(service: MediaService) -> None:
        calls.append("stop")
        await stop(service)

    monkeypatch.setattr(MediaService, "start", counted_start)
    monkeypatch.setattr(MediaService, "stop", counted_stop)
    store = tmp_path / "media"
    job_id = left_running(store / "jobs.sqlite3")
    gateway = await start_gateway(
        engine="sample-diffusion", engine_args=["--delay", "0"], media_store=str(store)
    )
    try:
        app = create_app(gateway)
        async with app.router.lifespan_context(app):
            assert calls == ["start"]
            transport = httpx.ASGITransport(app=app, client=LOOPBACK_CLIENT)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as http:
                video = (await http.get(f"/v1/videos/{job_id}")).json()
                capabilities = await http.get("/engine/capabilities")
        assert calls == ["start", "stop"]
    finally:
        await gateway.host.cleanup()
    assert video["status"] == "failed"
    assert video["error"]["message"] == INTERRUPTED_REASON
    assert capabilities.status_code == 200


def test_the_job_database_sits_next_to_a_local_store_unless_configured(tmp_path: Path) -> None:
    local = str(tmp_path / "media")
    assert job_db_path(Settings(), local, "m") == tmp_path / "media" / "jobs.sqlite3"
    remote = job_db_path(Settings(cache_dir=tmp_path), "http://127.0.0.1:9/media", "org/m")
    assert remote == tmp_path / "media-jobs" / "org_m.sqlite3"
    assert job_db_path(Settings(cache_dir=tmp_path), "memory://penstock-media", "m") is None
    chosen = tmp_path / "elsewhere.sqlite3"
    assert job_db_path(Settings(media_db=str(chosen)), local, "m") == chosen


def test_without_a_media_store_each_served_model_gets_its_own_folder(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    media = tmp_path / "media"
    assert media_store_location(settings, "org/My Model") == str(media / "org_My_Model")
    assert media_store_location(settings, "../up") == str(media / "_up")
    given = Settings(cache_dir=tmp_path, media_store="memory://shared")
    assert media_store_location(given, "org/My Model") == "memory://shared"


def test_a_server_without_media_imports_no_sqlalchemy_and_opens_no_job_database(
    tmp_path: Path,
) -> None:
    """``penstock serve --engine sample`` (an LLM) builds and serves with no job store."""
    code = f"""
        import asyncio, sys
        import penstock.app.cli, penstock.app.server
        from tests.support.inprocess import asgi_client, start_gateway

        async def main() -> None:
            gateway = await start_gateway(cache_dir={str(tmp_path)!r})
            try:
                async for http in asgi_client(gateway):
                    assert (await http.get("/v1/videos")).status_code == 200
                    body = {{"model": "sample-model", "prompt": "hi", "max_tokens": 2}}
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
            finally:
                await gateway.host.cleanup()

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.split(".")[0] == "sqlalchemy"))
        """
    result = run_snippet(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert not list(tmp_path.rglob("*.sqlite3"))


async def test_media_routes_of_a_server_without_media_answer_as_over_an_empty_store() -> None:
    gateway = await start_gateway()
    video_id = "video_" + "0" * 32
    try:
        async for http in asgi_client(gateway):
            listed = await http.get("/v1/videos")
            cursor = await http.get("/v1/videos", params={"after": video_id})
            missing = [
                await http.get(f"/v1/videos/{video_id}"),
                await http.get(f"/v1/videos/{video_id}/content"),
                await http.delete(f"/v1/videos/{video_id}"),
            ]
            image = await http.get(f"/v1/images/img_{'0' * 32}-0/content")
            refused = [
                await http.post(path, json={"model": "sample-model", "prompt": "a cat"})
                for path in ("/v1/videos", "/v1/videos/generations", "/v1/images/generations")
            ]
    finally:
        await gateway.host.cleanup()
    assert listed.status_code == 200
    assert listed.json() == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    assert cursor.status_code == 400 and cursor.json()["error"]["code"] == "invalid_cursor"
    for answer in missing:
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "video_not_found"
    assert image.status_code == 404 and image.json()["error"]["code"] == "image_not_found"
    for answer in refused:
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "model_not_supported" and error["param"] == "model"
