"""The response store as the event loop reaches it: opened on first use, every call off
the loop and bounded.

The store opens on the first request that reads or writes it (on a thread: creating its
table is a database round trip), so a server whose clients never use the Responses API
opens nothing and imports no SQLAlchemy. Each call then runs on the store's threads and
its caller waits at most :data:`~penstock.media.async_jobs.CALL_TIMEOUT_S`, then gets a
503 with ``Retry-After``, as the media job routes do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from penstock.errors import JobDatabaseError
from penstock.media.async_jobs import CALL_TIMEOUT_S, DaemonThreads
from penstock.media.records import Owner

if TYPE_CHECKING:
    from penstock.responses.records import StoredResponse
    from penstock.responses.store import ResponseStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Threads making the calls on a shared database; SQLite takes one.
_SHARED_THREADS = 4


class AsyncResponseStore:
    def __init__(self, locate: Callable[[], Path | str | None]) -> None:
        """``locate`` names the database (a SQLite file, None for memory, or a URL); it is
        asked on first use, as what it imports to find the media store's place is."""
        self._locate = locate
        self._store: ResponseStore | None = None
        self._threads: DaemonThreads | None = None
        self._opening = asyncio.Lock()

    async def _opened(self) -> tuple[ResponseStore, DaemonThreads]:
        if self._store is not None and self._threads is not None:
            return self._store, self._threads
        async with self._opening:
            if self._store is None or self._threads is None:
                from penstock.responses.store import ResponseStore, unavailable

                opener = DaemonThreads(1, "response-store-open")
                try:
                    pending = asyncio.get_running_loop().run_in_executor(
                        opener, lambda: ResponseStore(self._locate())
                    )
                    store = await asyncio.wait_for(pending, CALL_TIMEOUT_S)
                except TimeoutError:
                    raise unavailable(f"did not open within {CALL_TIMEOUT_S:g}s") from None
                except JobDatabaseError as exc:
                    # The reason may name the database's host: it goes to the log only.
                    logger.error("%s", exc)
                    raise unavailable("cannot be opened") from exc
                finally:
                    opener.shutdown()
                self._threads = DaemonThreads(
                    _SHARED_THREADS if store.shared else 1, "response-store"
                )
                self._store = store
            return self._store, self._threads

    async def _call(self, call: Callable[[ResponseStore], T]) -> T:
        store, threads = await self._opened()
        pending = asyncio.get_running_loop().run_in_executor(threads, call, store)
        try:
            return await asyncio.wait_for(pending, CALL_TIMEOUT_S)
        except TimeoutError:
            from penstock.responses.store import unavailable

            raise unavailable(f"did not answer within {CALL_TIMEOUT_S:g}s") from None

    async def tagger(self) -> Callable[[str], str]:
        """What turns an API key into the owner tag rows keep."""
        store, _ = await self._opened()
        return store.owner_tag

    async def add(self, owner: str, stored: StoredResponse) -> None:
        await self._call(lambda store: store.add(owner, stored))

    async def get(self, response_id: str, owner: Owner) -> StoredResponse | None:
        return await self._call(lambda store: store.get(response_id, owner))

    async def delete(self, response_id: str, owner: Owner) -> bool:
        return await self._call(lambda store: store.delete(response_id, owner))

    def close(self) -> None:
        """Close the store if it was opened; calls stuck on a database that hangs end alone."""
        if self._threads is not None:
            self._threads.shutdown()
        if self._store is not None:
            self._store.close()
