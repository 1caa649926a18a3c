"""Video job records in SQLite (stdlib ``sqlite3``): they outlive the process.

One connection, used from the event loop thread only; every write commits at once (WAL,
so readers never wait). The engine request of each job is stored too, so a job still
queued when the process stopped can run after a restart.

Jobs and stored images belong to the API key that created them: each row keeps an owner
tag, an HMAC-SHA256 of the key under a random secret kept in the database, never the key.
The empty tag is the shared scope: jobs made with no keys configured, and jobs from
databases older than the owner column (migrated on open), which every caller sees.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
UNFINISHED = (QUEUED, IN_PROGRESS)
SHARED_OWNER = ""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS video_jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    seconds TEXT NOT NULL,
    size TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    artifact TEXT,
    content_type TEXT,
    inference_time_s REAL,
    request TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
)
"""

_META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"

_IMAGES_SCHEMA = """
CREATE TABLE IF NOT EXISTS stored_images (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at INTEGER NOT NULL
)
"""

_COLUMNS = (
    "id",
    "model",
    "prompt",
    "status",
    "progress",
    "created_at",
    "completed_at",
    "seconds",
    "size",
    "error_code",
    "error_message",
    "artifact",
    "content_type",
    "inference_time_s",
    "request",
    "owner",
)


@dataclass(frozen=True)
class Owner:
    """Whose jobs a caller sees: its own tag and the shared scope, or all (admin keys)."""

    tag: str = SHARED_OWNER
    sees_all: bool = False

    def sees(self, owner: str) -> bool:
        return self.sees_all or owner in (self.tag, SHARED_OWNER)

    def tags(self) -> tuple[str, ...] | None:
        """The owner tags visible to this caller; None for every tag."""
        if self.sees_all:
            return None
        return (SHARED_OWNER,) if self.tag == SHARED_OWNER else (self.tag, SHARED_OWNER)


@dataclass
class VideoJob:
    """One video generation job; ``artifact`` is a store key or, for engines that answer
    with a remote URL, that URL."""

    id: str
    model: str
    prompt: str
    seconds: str
    size: str
    request: dict[str, Any]
    status: str = QUEUED
    progress: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    artifact: str | None = None
    content_type: str | None = None
    inference_time_s: float | None = None
    owner: str = SHARED_OWNER

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED

    def video_object(self, queue_position: int | None = None) -> dict[str, Any]:
        """The OpenAI ``video`` object (plus ``queue_position`` while queued)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": None,
            "prompt": self.prompt,
            "seconds": self.seconds,
            "size": self.size,
            "remixed_from_video_id": None,
            "error": (
                {"code": self.error_code or "generation_failed", "message": self.error_message}
                if self.status == FAILED
                else None
            ),
        }
        if queue_position is not None:
            body["queue_position"] = queue_position
        return body


def _row_to_job(row: sqlite3.Row) -> VideoJob:
    values = {name: row[name] for name in _COLUMNS}
    values["request"] = json.loads(values["request"])
    return VideoJob(**values)


class JobStore:
    """CRUD over the ``video_jobs`` table; newest first means highest insertion order."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None keeps the jobs in memory only, for stores that don't outlive the
        process either."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(
            path if path is not None else ":memory:", isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.execute(_META_SCHEMA)
        self._db.execute(_IMAGES_SCHEMA)
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(video_jobs)")}
        if "owner" not in columns:
            self._db.execute("ALTER TABLE video_jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        self._db.execute(
            "INSERT OR IGNORE INTO meta (name, value) VALUES ('owner_secret', ?)",
            (secrets.token_hex(32),),
        )
        row = self._db.execute("SELECT value FROM meta WHERE name = 'owner_secret'").fetchone()
        self._owner_secret = bytes.fromhex(row["value"])

    def owner_tag(self, api_key: str) -> str:
        """What the rows of ``api_key``'s jobs store: a keyed hash, so the key never is."""
        return hmac.new(self._owner_secret, api_key.encode(), hashlib.sha256).hexdigest()

    def close(self) -> None:
        self._db.close()

    def add(self, job: VideoJob) -> None:
        values = [getattr(job, name) for name in _COLUMNS]
        values[_COLUMNS.index("request")] = json.dumps(job.request)
        placeholders = ", ".join("?" for _ in _COLUMNS)
        self._db.execute(
            f"INSERT INTO video_jobs ({', '.join(_COLUMNS)}) VALUES ({placeholders})", values
        )

    def get(self, job_id: str, owner: Owner | None = None) -> VideoJob | None:
        """The job, or None when there is none or ``owner`` (if given) may not see it."""
        row = self._db.execute("SELECT * FROM video_jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (owner is not None and not owner.sees(row["owner"])):
            return None
        return _row_to_job(row)

    def update(self, job_id: str, **changes: Any) -> None:
        unknown = set(changes) - set(_COLUMNS) - {"request"}
        if unknown:
            raise KeyError(f"unknown job fields: {sorted(unknown)}")
        assignments = ", ".join(f"{name} = ?" for name in changes)
        self._db.execute(
            f"UPDATE video_jobs SET {assignments} WHERE id = ?", [*changes.values(), job_id]
        )

    def delete(self, job_id: str) -> bool:
        return self._db.execute("DELETE FROM video_jobs WHERE id = ?", (job_id,)).rowcount > 0

    def page(
        self,
        *,
        limit: int,
        after: str | None = None,
        newest_first: bool = True,
        owner: Owner | None = None,
    ) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs ``owner`` sees after the cursor job ``after``; and whether
        more follow.

        An ``after`` that names no job ``owner`` sees gives :class:`KeyError`.
        """
        op, order = ("<", "DESC") if newest_first else (">", "ASC")
        conditions: list[str] = []
        params: list[Any] = []
        tags = owner.tags() if owner is not None else None
        if tags is not None:
            conditions.append(f"owner IN ({', '.join('?' for _ in tags)})")
            params.extend(tags)
        if after is not None:
            row = self._db.execute(
                "SELECT seq, owner FROM video_jobs WHERE id = ?", (after,)
            ).fetchone()
            if row is None or (owner is not None and not owner.sees(row["owner"])):
                raise KeyError(after)
            conditions.append(f"seq {op} ?")
            params.append(row["seq"])
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        rows = self._db.execute(
            f"SELECT * FROM video_jobs {where} ORDER BY seq {order} LIMIT ?", [*params, limit + 1]
        ).fetchall()
        return [_row_to_job(r) for r in rows[:limit]], len(rows) > limit

    def count_by_status(self) -> dict[str, int]:
        rows = self._db.execute("SELECT status, COUNT(*) FROM video_jobs GROUP BY status")
        return {status: count for status, count in rows.fetchall()}

    def unfinished(self) -> list[VideoJob]:
        rows = self._db.execute(
            "SELECT * FROM video_jobs WHERE status IN (?, ?) ORDER BY seq ASC", UNFINISHED
        ).fetchall()
        return [_row_to_job(r) for r in rows]

    def add_image(self, image_id: str, owner: str) -> None:
        self._db.execute(
            "INSERT INTO stored_images (id, owner, created_at) VALUES (?, ?, ?)",
            (image_id, owner, int(time.time())),
        )

    def image_visible(self, image_id: str, owner: Owner) -> bool:
        """Whether ``owner`` may download the stored image; images stored before owners
        were recorded have no row and stay shared."""
        row = self._db.execute(
            "SELECT owner FROM stored_images WHERE id = ?", (image_id,)
        ).fetchone()
        return row is None or owner.sees(row["owner"])
