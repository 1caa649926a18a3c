"""The job store as the event loop reaches it: every call on a thread of its own, bounded.

:class:`~penstock.media.jobs.JobStore` calls block on the database. Made on the event
loop, one that hangs (a stopped server, a lost network) would freeze every route of the
gateway, ``/live`` included; here each call runs on a small pool of threads and the
caller waits at most :data:`CALL_TIMEOUT_S` for it, then gets
:class:`~penstock.errors.JobStoreUnavailableError` (503 with ``Retry-After``). A call
still waiting for a thread when its caller gives up never starts. A call already running
ends on its own, within the store's statement and socket bounds, or when a stopped server
resumes.

SQLAlchemy is imported only when a store is opened here (or a ``--media-db`` URL is
checked), never by a server whose models generate no media.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from penstock.errors import JobStoreUnavailableError
from penstock.media.records import Owner, PageQuery, VideoJob, is_database_url

if TYPE_CHECKING:
    from penstock.media.jobs import JobStore

logger = logging.getLogger(__name__)

# The longest a route or the job upkeep waits for one store call.
CALL_TIMEOUT_S = 5.0
# The longest a metrics scrape waits for fresh job counts before it shows the last ones.
SCRAPE_WAIT_S = 0.1

T = TypeVar("T")
P = ParamSpec("P")
_Call = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class DaemonThreads(concurrent.futures.Executor):
    """A fixed set of daemon threads taking calls in order. The standard pool's threads
    are joined when the interpreter exits; one stuck on a database that hangs would keep
    a stopped gateway from exiting."""

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._closed = False
        self._work: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        for index in range(count):
            threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True).start()

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the job store is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._work.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; the ones waiting are cancelled. Never waits."""
        self._closed = True
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._work.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in range(self._count):
            self._work.put(None)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


def check_database(location: str | None) -> None:
    """Open (creating or migrating its tables) the database a ``--media-db`` URL names, so
    a wrong URL or a server that is down fails before a model loads, in one line.

    SQLAlchemy is imported only for a URL: a file path is checked where it is opened.
    """
    if location is not None and is_database_url(location.strip()):
        from penstock.media.jobs import JobStore

        JobStore(location.strip()).close()


class AsyncJobStore:
    """The calls of a :class:`~penstock.media.jobs.JobStore` as coroutines, off the loop.

    ``sync`` is the store itself, for the steps that run before the gateway serves
    (registering, the first settlement) and for nothing that runs while it does.
    """

    def __init__(self, location: Path | str | None) -> None:
        from penstock.media.jobs import POOL_CONNECTIONS, JobStore

        self.sync: JobStore = JobStore(location)
        # One thread for SQLite, whose writes take turns anyway (and whose in-memory
        # database is one connection); on PostgreSQL one per pooled connection.
        self._threads = DaemonThreads(POOL_CONNECTIONS if self.sync.shared else 1, "job-store")
        self._counts: dict[str, int] = {}
        self._counting: concurrent.futures.Future[dict[str, int]] | None = None

    @property
    def url(self) -> str:
        return self.sync.url

    @property
    def shared(self) -> bool:
        return self.sync.shared

    def owner_tag(self, api_key: str) -> str:
        return self.sync.owner_tag(api_key)

    async def _call(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        pending = loop.run_in_executor(self._threads, lambda: call(*args, **kwargs))
        try:
            # On timeout the call is cancelled: one not started yet never runs.
            return await asyncio.wait_for(pending, CALL_TIMEOUT_S)
        except TimeoutError:
            from penstock.media.jobs import unavailable

            raise unavailable(f"did not answer within {CALL_TIMEOUT_S:g}s") from None

    def close(self) -> None:
        """Close the store; calls stuck on a database that hangs are left to end alone."""
        self._threads.shutdown()
        self.sync.close()

    # -- what routes read --------------------------------------------------------------

    async def get(self, job_id: str, owner: Owner | None = None) -> VideoJob | None:
        return await self._call(self.sync.get, job_id, owner)

    async def page(self, query: PageQuery) -> tuple[list[VideoJob], bool]:
        return await self._call(self.sync.page, query)

    async def image_visible(self, image_id: str, owner: Owner) -> bool:
        return await self._call(self.sync.image_visible, image_id, owner)

    async def queue_position(self, job_id: str) -> int | None:
        return await self._call(self.sync.queue_position, job_id)

    # -- what the media service writes -------------------------------------------------

    async def add(self, job: VideoJob) -> None:
        """Store a new job; one whose caller gets 503 is not left behind in the store."""
        given_up = threading.Event()
        try:
            await self._call(self.sync.add, job, given_up)
        except JobStoreUnavailableError:
            given_up.set()
            raise

    async def add_image(self, image_id: str, owner: str) -> None:
        await self._call(self.sync.add_image, image_id, owner)

    async def update(self, job_id: str, held_by: str | None = None, **changes: Any) -> bool:
        return await self._call(self.sync.update, job_id, held_by, **changes)

    async def delete(self, job_id: str) -> bool:
        return await self._call(self.sync.delete, job_id)

    async def claim(self, job_id: str, gateway: str) -> bool:
        return await self._call(self.sync.claim, job_id, gateway)

    async def existing(self, job_ids: Collection[str]) -> set[str]:
        return await self._call(self.sync.existing, set(job_ids))

    async def beat(self, gateway: str) -> dict[str, int]:
        return await self._call(self.sync.beat, gateway)

    async def forget(self, gateway_ids: Collection[str]) -> None:
        await self._call(self.sync.forget, list(gateway_ids))

    async def settle(
        self, live: Collection[str], adopter: str, reason: str
    ) -> tuple[list[str], list[str]]:
        return await self._call(self.sync.settle, set(live), adopter, reason)

    # -- metrics -----------------------------------------------------------------------

    def counts_now(self) -> dict[str, int]:
        """Jobs by status for a scrape, which runs on the event loop: a fresh count if the
        database gives it within :data:`SCRAPE_WAIT_S`, else the last one it gave."""
        if self._counting is None or self._counting.done():
            self._counting = self._threads.submit(self.sync.count_by_status)
            self._counting.add_done_callback(self._keep_counts)
            try:
                self._counts = self._counting.result(timeout=SCRAPE_WAIT_S)
            except concurrent.futures.TimeoutError:
                logger.warning("video job counts: the database is slow; showing the last ones")
            except Exception as exc:
                logger.warning("video job counts: %s; showing the last ones", exc)
        return dict(self._counts)

    def _keep_counts(self, counting: concurrent.futures.Future[dict[str, int]]) -> None:
        """Keep a count that came after its scrape stopped waiting, for the next one."""
        if not counting.cancelled() and counting.exception() is None:
            self._counts = counting.result()
