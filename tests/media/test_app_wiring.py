"""The app builds the media service from the settings and runs it once per lifespan."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from penstock.app.factory import create_app, job_db_path, media_store_location
from penstock.media.jobs import IN_PROGRESS, JobStore, VideoJob
from penstock.media.service import INTERRUPTED_REASON, MediaService
from penstock.settings import Settings
from tests.support.inprocess import LOOPBACK_CLIENT, start_gateway


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
    gateway = await start_gateway(media_store=str(store))
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
