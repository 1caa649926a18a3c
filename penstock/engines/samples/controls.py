"""The sample engine's lifecycle controls, simulated but observable through ``generate``.

* **pause** ``{mode}``: ``abort`` ends in-flight requests at once (``finish_reason``
  ``"abort"``), ``wait`` returns once they have finished, ``keep`` freezes them in place
  until resume. Requests that arrive while paused or asleep wait and run after resume.
* **sleep** ``{level, mode, tags}`` / **wake_up** ``{tags}`` hold generation like a pause
  until every released tag (``weights``, ``kv_cache``) is awake again; releasing the KV
  cache empties the prefix cache.
* **flush_cache** empties the prefix cache; **abort_request** ends requests by
  ``context.id()``, or all of them (``abort_all``).

Bodies and answers are those of :mod:`penstock.engines.controls`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from penstock.engines import controls
from penstock.engines.context import Context
from penstock.engines.controls import Body, Handler

ADMIN_ABORT_REASON = "abort"


@dataclass(eq=False)
class Flight:
    """One request inside ``generate``, as the admin controls see it."""

    context: Context
    prompt_tokens: int = 0
    admitted: bool = False
    abort_reason: str | None = None
    generated: int = 0
    # ``generated`` at the latest simulated forward pass.
    reported: int = 0


@dataclass
class Hold:
    """Why generation is held (a pause or a sleep) and what happens to in-flight work."""

    mode: str
    tags: set[str] = field(default_factory=set)
    level: int | None = None


class SampleLifecycleControls:
    """Holds, in-flight requests and the controls over them (mixed into the engine)."""

    _holds: dict[str, Hold]
    _flights: set[Flight]
    _changed: asyncio.Event | None
    # Empties the prefix cache; returns how many prompts it held.
    _clear_prefix_cache: Callable[[], int]

    def lifecycle_controls(self) -> dict[str, Handler]:
        return {
            controls.PAUSE: self._pause,
            controls.RESUME: self._resume,
            controls.IS_PAUSED: self._is_paused,
            controls.SLEEP: self._sleep,
            controls.WAKE_UP: self._wake_up,
            controls.IS_SLEEPING: self._is_sleeping,
            controls.FLUSH_CACHE: self._flush_cache,
            controls.ABORT_REQUEST: self._abort_request,
        }

    def _notify(self) -> None:
        """Wake everything waiting on the hold state or the set of in-flight requests."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _next_change(self) -> asyncio.Event:
        """The event :meth:`_notify` sets next. Made only once something waits: every
        request that ends notifies, and nearly always nothing waits."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _blocked(self, flight: Flight) -> bool:
        if not self._holds:
            return False
        if not flight.admitted:
            return True
        return any(hold.mode == "keep" for hold in self._holds.values())

    async def _hold_while_blocked(self, flight: Flight) -> None:
        while (
            self._blocked(flight)
            and flight.abort_reason is None
            and not flight.context.is_stopped()
        ):
            changed = asyncio.ensure_future(self._next_change().wait())
            stopped = asyncio.ensure_future(flight.context.async_killed_or_stopped())
            try:
                await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                stopped.cancel()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._next_change().wait()

    def _abort_where(self, matches: Callable[[Flight], bool]) -> list[str]:
        aborted = []
        for flight in self._flights:
            if flight.abort_reason is None and matches(flight):
                flight.abort_reason = ADMIN_ABORT_REASON
                aborted.append(flight.context.id())
        self._notify()
        return aborted

    async def _apply_hold(self, key: str, hold: Hold) -> list[str]:
        """Hold new requests; abort, drain or freeze the in-flight ones per ``hold.mode``."""
        self._holds[key] = hold
        aborted = self._abort_where(lambda f: f.admitted) if hold.mode == "abort" else []
        self._notify()
        if hold.mode == "wait":
            await self._wait_until(lambda: not any(f.admitted for f in self._flights))
        return aborted

    async def _pause(self, body: Body) -> Body:
        pause = controls.parse_pause(body)
        aborted = await self._apply_hold("pause", Hold(pause.mode))
        if pause.clear_cache:
            self._clear_prefix_cache()
        return controls.paused(pause.mode, aborted)

    async def _resume(self, body: Body) -> Body:
        self._holds.pop("pause", None)
        self._notify()
        return controls.resumed("sleep" in self._holds)

    async def _is_paused(self, body: Body) -> Body:
        return controls.pause_state("pause" in self._holds)

    async def _sleep(self, body: Body) -> Body:
        sleep = controls.parse_sleep(body)
        current = self._holds.get("sleep")
        if current is not None:
            current.tags |= sleep.tags
            aborted: list[str] = []
        else:
            aborted = await self._apply_hold(
                "sleep", Hold(sleep.mode, set(sleep.tags), sleep.level)
            )
        if "kv_cache" in sleep.tags:
            self._clear_prefix_cache()
        hold = self._holds["sleep"]
        level = hold.level if hold.level is not None else sleep.level
        return controls.sleeping(level, hold.tags, aborted)

    async def _wake_up(self, body: Body) -> Body:
        wake = controls.parse_wake(body)
        hold = self._holds.get("sleep")
        if hold is None:
            return controls.woke(())
        hold.tags -= wake.tags
        if not hold.tags:
            del self._holds["sleep"]
            self._notify()
        return controls.woke(hold.tags)

    async def _is_sleeping(self, body: Body) -> Body:
        hold = self._holds.get("sleep")
        return controls.sleep_state(hold.tags if hold else ())

    async def _flush_cache(self, body: Body) -> Body:
        return controls.flushed(self._clear_prefix_cache())

    async def _abort_request(self, body: Body) -> Body:
        wanted = controls.parse_abort(body)
        return controls.aborted(self._abort_where(lambda f: wanted.matches(f.context.id())))
