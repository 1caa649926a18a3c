"""The job store (SQLite and PostgreSQL), the artifact store (folder or fsspec URL) and the
worker pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from penstock.media.artifacts import ArtifactStore, local_folder
from penstock.media.jobs import JobStore
from penstock.media.pool import WorkerPool
from penstock.media.records import COMPLETED, IN_PROGRESS, PageQuery, VideoJob


def job(job_id: str, **fields: object) -> VideoJob:
    return VideoJob(
        id=job_id, model="m", prompt="p", seconds="1", size="64x64", request={"a": 1}, **fields
    )  # type: ignore[arg-type]


def test_jobs_survive_reopening_the_database(job_db: Path | str) -> None:
    store = JobStore(job_db)
    store.add(job("a"))
    store.update("a", status=COMPLETED, progress=100, artifact="videos/a.mp4")
    store.close()
    reopened = JobStore(job_db)
    found = reopened.get("a")
    assert found is not None
    assert (found.status, found.progress, found.artifact, found.request) == (
        COMPLETED,
        100,
        "videos/a.mp4",
        {"a": 1},
    )
    assert reopened.delete("a") and reopened.get("a") is None and not reopened.delete("a")


def test_pages_are_newest_first_with_a_cursor(job_db: Path | str) -> None:
    store = JobStore(job_db)
    for name in "abcde":
        store.add(job(name))
    first, more = store.page(PageQuery(2))
    assert [j.id for j in first] == ["e", "d"] and more
    rest, more = store.page(PageQuery(5, after="d"))
    assert [j.id for j in rest] == ["c", "b", "a"] and not more
    oldest, _ = store.page(PageQuery(2, newest_first=False))
    assert [j.id for j in oldest] == ["a", "b"]
    with pytest.raises(KeyError):
        store.page(PageQuery(2, after="nope"))


def test_unfinished_jobs_are_found_in_submission_order(job_db: Path | str) -> None:
    store = JobStore(job_db)
    store.add(job("a", status=IN_PROGRESS))
    store.add(job("b", status=COMPLETED))
    store.add(job("c"))
    assert [j.id for j in store.unfinished()] == ["a", "c"]


@pytest.mark.parametrize("location", ["folder", "file", "memory"])
def test_artifacts_round_trip_with_ranges(tmp_path: Path, location: str) -> None:
    url = {
        "folder": str(tmp_path / "store"),
        "file": f"file://{tmp_path}/store",
        "memory": f"memory://penstock-test/{tmp_path.name}",
    }[location]
    store = ArtifactStore(url)
    store.put("videos/v.mp4", b"0123456789")
    assert store.size("videos/v.mp4") == 10
    assert store.read("videos/v.mp4", 2, 5) == b"234"
    assert store.read("videos/v.mp4") == b"0123456789"
    store.delete("videos/v.mp4")
    assert store.size("videos/v.mp4") is None
    with pytest.raises(ValueError):
        store.put("../escape", b"x")


def test_a_file_url_store_is_the_percent_decoded_folder(tmp_path: Path) -> None:
    folder = tmp_path / "media store"
    assert local_folder(folder.as_uri()) == folder
    ArtifactStore(folder.as_uri()).put("images/a.png", b"png")
    assert (folder / "images" / "a.png").read_bytes() == b"png"
    assert not (tmp_path / "media%20store").exists()


async def test_pool_runs_at_most_size_at_once_and_reports_positions() -> None:
    pool = WorkerPool(2)
    pool.start()
    release = asyncio.Event()
    running: list[str] = []
    finished: list[str] = []

    def work(name: str):  # type: ignore[no-untyped-def]
        async def run() -> None:
            running.append(name)
            await release.wait()
            finished.append(name)

        return run

    for name in "abcd":
        pool.submit(name, work(name))
    await asyncio.sleep(0.05)
    assert running == ["a", "b"]
    assert [pool.position(n) for n in "abcd"] == [None, None, 1, 2]
    assert pool.withdraw("c") and not pool.withdraw("c")
    assert pool.position("d") == 1
    release.set()
    for _ in range(100):
        if len(finished) == 3:
            break
        await asyncio.sleep(0.01)
    assert sorted(finished) == ["a", "b", "d"]
    await pool.stop()
