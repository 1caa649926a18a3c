"""Detached tasks that nobody awaits, kept referenced until they end."""

from __future__ import annotations

import asyncio
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
