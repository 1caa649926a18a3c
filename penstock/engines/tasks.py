"""Detached tasks that nobody awaits, kept referenced until they end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


def spawn_kept(
    background: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any]
) -> asyncio.Task[Any]:
    """Run ``coro`` as a task of its own, held in ``background`` until it is done: the event
    loop keeps only weak references to tasks, and a caller's cancellation does not reach it."""
    task = asyncio.get_running_loop().create_task(coro)
    background.add(task)
    task.add_done_callback(background.discard)
    return task


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and return once it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
