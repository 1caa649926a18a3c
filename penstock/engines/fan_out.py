"""``n`` > 1 on an engine that yields one choice per request: ``n`` single-choice
requests (child contexts, seeds ``seed + i``) merged as the choices of one stream.

Stopping or killing the parent stops or kills every child; each child is a request of
its own to the engine (aborted once by the host), the parent is none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from penstock.engines.context import Context
from penstock.engines.handoff import END


def _choice_request(request: dict[str, Any], index: int) -> dict[str, Any]:
    """Choice ``index`` of a fanned-out request: ``n`` = 1 and, when a seed was given,
    ``seed + index`` (so choices differ yet replay)."""
    sampling = dict(request.get("sampling_options") or {})
    sampling["n"] = 1
    seed = sampling.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        sampling["seed"] = seed + index
    return {**request, "sampling_options": sampling}


async def fan_out(
    request: dict[str, Any],
    parent: Context,
    n: int,
    *,
    run_choice: Callable[[dict[str, Any], Context], AsyncGenerator[dict, None]],
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    cancel: Callable[[Context], None],
) -> AsyncGenerator[dict, None]:
    """The ``n`` choices of ``request``, each run by ``run_choice`` in a task ``spawn``
    made; ``cancel`` stops a child when the parent stops."""
    children = [parent.detached(f"{parent.id()}-{i}") for i in range(n)]
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    async def run(index: int) -> None:
        stream = run_choice(_choice_request(request, index), children[index])
        try:
            async for chunk in stream:
                chunk["index"] = index
                await queue.put((chunk, None))
        except Exception as exc:
            await queue.put((END, exc))
            return
        finally:
            await stream.aclose()
        await queue.put((END, None))

    async def propagate_stop() -> None:
        await parent.async_killed_or_stopped()
        for child in children:
            if parent.is_killed():
                child.kill()
            cancel(child)

    watcher = spawn(propagate_stop())
    runs = [spawn(run(i)) for i in range(n)]
    remaining = n
    try:
        while remaining:
            chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is END:
                remaining -= 1
                continue
            yield chunk
    finally:
        watcher.cancel()
        for task in runs:
            task.cancel()
