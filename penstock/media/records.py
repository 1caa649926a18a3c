"""What a video job is, without a database: states, owners, the job record, and the view
of the records that routes read.

Every server imports this module; the SQLAlchemy store (:mod:`penstock.media.jobs`) is
imported only where one is opened, which a server does only when one of its models
generates media (:func:`penstock.media.requests.generates_media`). A server without one
reads :data:`NO_JOBS`: no job and no stored image is ever found there, so its media
routes answer as over an empty store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
UNFINISHED = (QUEUED, IN_PROGRESS)
SHARED_OWNER = ""


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
    # The gateway holding the job; None for jobs of databases older than the column.
    runner: str | None = None

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


@dataclass(frozen=True)
class PageQuery:
    """One page of a job listing: up to ``limit`` jobs ``owner`` (all, if None) sees after
    the cursor job ``after``, newest or oldest first."""

    limit: int
    after: str | None = None
    newest_first: bool = True
    owner: Owner | None = None


class JobRecords(Protocol):
    """The lookups of jobs and stored images that routes make before they hold a job;
    each may wait on the database, so none blocks the event loop."""

    def owner_tag(self, api_key: str) -> str: ...

    async def get(self, job_id: str, owner: Owner | None = None) -> VideoJob | None: ...

    async def page(self, query: PageQuery) -> tuple[list[VideoJob], bool]: ...

    async def image_visible(self, image_id: str, owner: Owner) -> bool: ...


class _NoJobs:
    """The records of a server whose models generate no media: empty, always."""

    def owner_tag(self, api_key: str) -> str:
        return SHARED_OWNER

    async def get(self, job_id: str, owner: Owner | None = None) -> VideoJob | None:
        return None

    async def page(self, query: PageQuery) -> tuple[list[VideoJob], bool]:
        if query.after is not None:
            raise KeyError(query.after)
        return [], False

    async def image_visible(self, image_id: str, owner: Owner) -> bool:
        return False


NO_JOBS: JobRecords = _NoJobs()


def is_database_url(location: str | None) -> bool:
    """Whether a ``--media-db`` value is a database URL rather than a SQLite file path."""
    return bool(location) and "://" in str(location)
