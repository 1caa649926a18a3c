"""The job store tests run on both backends: ``job_db`` is a fresh SQLite file or a fresh
database on one PostgreSQL server started for the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import fresh_database, running_postgres


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with running_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def job_db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    if request.param == "sqlite":
        return tmp_path / "jobs.sqlite3"
    return fresh_database(request.getfixturevalue("postgres_url"))
