"""One job database, several gateways: what each sees and who runs what, on SQLite and
PostgreSQL; older databases are migrated on open; bad URLs fail in one line."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import psycopg
import pytest

from penstock.errors import JobDatabaseError, JobStoreUnavailableError
from penstock.media.jobs import JobStore
from penstock.media.records import (
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    Owner,
    PageQuery,
    VideoJob,
)
from tests.support.server import free_port


def job(job_id: str, **fields: object) -> VideoJob:
    return VideoJob(
        id=job_id, model="m", prompt="p", seconds="1", size="64x64", request={"a": 1}, **fields
    )  # type: ignore[arg-type]


def test_every_gateway_computes_the_same_owner_tags(job_db: Path | str) -> None:
    first, second = JobStore(job_db), JobStore(job_db)
    assert first.owner_tag("sk-a") == second.owner_tag("sk-a") != first.owner_tag("sk-b")
    first.add(job("mine", owner=first.owner_tag("sk-a")))
    first.add(job("shared"))
    other = Owner(second.owner_tag("sk-b"))
    assert second.get("mine", Owner(second.owner_tag("sk-a"))) is not None
    assert second.get("mine", other) is None
    assert [j.id for j in second.page(PageQuery(10, owner=other))[0]] == ["shared"]
    first.close()
    second.close()


def test_the_jobs_of_a_dead_gateway_are_adopted_once_or_failed(job_db: Path | str) -> None:
    store, rival = JobStore(job_db), JobStore(job_db)
    store.add(job("running", status=IN_PROGRESS, runner="dead"))
    store.add(job("waiting", runner="dead"))
    store.add(job("legacy"))  # a database older than the runner column
    store.add(job("alive", runner="live"))
    store.add(job("done", status=COMPLETED, runner="dead"))
    adopted, failed = store.settle({"me", "live"}, "me", "its gateway died")
    assert (adopted, failed) == (["waiting", "legacy"], ["running"])
    assert rival.settle({"rival", "live", "me"}, "rival", "its gateway died") == ([], [])
    interrupted = store.get("running")
    assert interrupted is not None and interrupted.status == FAILED
    assert interrupted.error_code == "interrupted"
    assert interrupted.error_message == "its gateway died"
    assert store.queue_position("legacy") == 2 and store.queue_position("alive") == 1
    assert not rival.claim("waiting", "rival")
    assert store.claim("waiting", "me") and not store.claim("waiting", "me")
    assert store.get("waiting").status == IN_PROGRESS  # type: ignore[union-attr]
    store.close()
    rival.close()


def test_a_job_whose_caller_was_refused_meanwhile_is_rolled_back(job_db: Path | str) -> None:
    store = JobStore(job_db)
    given_up = threading.Event()
    given_up.set()
    with pytest.raises(JobStoreUnavailableError) as refused:
        store.add(job("late"), given_up)
    assert refused.value.headers["Retry-After"]
    assert store.get("late") is None
    store.add(job("on-time"), threading.Event())
    assert store.get("on-time") is not None
    store.close()


def test_only_the_runner_finishes_a_job(job_db: Path | str) -> None:
    store = JobStore(job_db)
    store.add(job("a", runner="me"))
    assert store.claim("a", "me")
    assert not store.update("a", held_by="other", status=COMPLETED)
    assert store.settle({"other"}, "other", "gone") == ([], ["a"])
    assert not store.update("a", held_by="me", status=COMPLETED)
    assert store.get("a").status == FAILED  # type: ignore[union-attr]
    store.close()


def test_gateways_beat_and_are_forgotten(job_db: Path | str) -> None:
    store = JobStore(job_db)
    store.register("a")
    store.register("b")
    assert store.beat("a") == {"a": 1, "b": 0}
    store.forget(["a"])
    assert store.beat("a") == {"a": 0, "b": 0}  # registered again
    assert store.existing(["x", "y"]) == set()
    store.add(job("x"))
    assert store.existing(["x", "y"]) == {"x"}
    store.close()


_OLD_SCHEMA = """
CREATE TABLE video_jobs (
    seq {seq},
    id TEXT NOT NULL UNIQUE, model TEXT NOT NULL, prompt TEXT NOT NULL, status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL, completed_at INTEGER,
    seconds TEXT NOT NULL, size TEXT NOT NULL, error_code TEXT, error_message TEXT,
    artifact TEXT, content_type TEXT, inference_time_s REAL, request TEXT NOT NULL
)
"""
_OLD_ROW = (
    "INSERT INTO video_jobs (id, model, prompt, status, created_at, seconds, size, request) "
    "VALUES ('old', 'm', 'p', 'completed', 1, '1', '64x64', '{}')"
)


def test_a_database_from_before_owners_and_runners_is_migrated(job_db: Path | str) -> None:
    if isinstance(job_db, Path):
        with sqlite3.connect(job_db) as conn:
            conn.execute(_OLD_SCHEMA.format(seq="INTEGER PRIMARY KEY AUTOINCREMENT"))
            conn.execute(_OLD_ROW)
    else:
        with psycopg.connect(job_db.replace("+psycopg", "")) as conn:
            conn.execute(_OLD_SCHEMA.format(seq="BIGSERIAL PRIMARY KEY"))
            conn.execute(_OLD_ROW)
    store = JobStore(job_db)
    old = store.get("old", Owner(store.owner_tag("sk-a")))
    assert old is not None and (old.owner, old.runner) == ("", None)
    store.add(job("new"))
    assert [j.id for j in store.page(PageQuery(5))[0]] == ["new", "old"]
    store.close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://root@127.0.0.1/jobs", "the 'mysql' backend is not supported"),
        ("://nowhere", "is not a database URL"),
        ("postgresql+psycopg://u@h:port/db", "is not a database URL"),
    ],
)
def test_an_unusable_database_url_fails_in_one_line(url: str, says: str) -> None:
    with pytest.raises(JobDatabaseError, match=says):
        JobStore(url)


def test_a_database_that_cannot_be_reached_fails_startup_without_its_password() -> None:
    url = f"postgresql+psycopg://u:secret@127.0.0.1:{free_port()}/jobs?connect_timeout=2"
    with pytest.raises(JobDatabaseError) as caught:
        JobStore(url)
    assert "cannot open the job database" in caught.value.message
    assert "secret" not in caught.value.message and "***" in caught.value.message


def test_a_database_gone_while_serving_is_a_503(postgres_url: str) -> None:
    from tests.support.postgres import fresh_database

    url = fresh_database(postgres_url)
    store = JobStore(url)
    store.add(job("a", status=QUEUED))
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(postgres_url.replace("+psycopg", ""), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    with pytest.raises(JobStoreUnavailableError) as caught:
        store.get("a")
    assert caught.value.status_code == 503
    store.close()
