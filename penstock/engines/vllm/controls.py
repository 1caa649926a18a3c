"""The vllm engine's controls, each a call on vLLM's ``AsyncLLM``.

* **pause** ``{mode, clear_cache}`` / **resume**: vLLM's ``pause_generation`` (``abort``,
  ``wait`` and ``keep`` are vLLM's own modes) and ``resume_generation``; the answer names
  the requests an ``abort`` pause ended.
* **sleep** / **wake_up**: vLLM's ``sleep`` and ``wake_up``. On the CPU they hold and
  release generation and free nothing (vLLM's CPU backend keeps its weights and KV
  cache), so the answer says ``freed: []`` with the reason; on CUDA they release the
  tags asked.
* **abort_request**, **flush_cache** (vLLM's ``reset_prefix_cache``; refused while
  requests run, as vLLM refuses it), **get_weight_version** (vLLM's own version).

Bodies and answers are those of :mod:`penstock.engines.controls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from penstock.engines import controls
from penstock.engines.context import Context
from penstock.engines.controls import Body, ControlRejected, Handler

CPU_SLEEP_NOTE = (
    "nothing was freed: vLLM's CPU backend keeps its weights and KV cache in memory while "
    "asleep; generation is held until wake_up"
)


class VllmControls:
    """Pause, sleep, wake, abort and flush on ``AsyncLLM`` (mixed into the engine)."""

    _in_flight: dict[str, Context]
    _require_llm: Callable[[], Any]
    on_cpu: bool

    def __init__(self) -> None:
        self._sleep_tags: set[str] = set()
        self._sleep_level = 1

    def lifecycle_controls(self) -> dict[str, Handler]:
        return {
            controls.PAUSE: self._pause,
            controls.RESUME: self._resume,
            controls.IS_PAUSED: self._is_paused,
            controls.SLEEP: self._sleep,
            controls.WAKE_UP: self._wake_up,
            controls.IS_SLEEPING: self._is_sleeping,
            controls.ABORT_REQUEST: self._abort_request,
            controls.FLUSH_CACHE: self._flush_cache,
            controls.GET_WEIGHT_VERSION: self._get_weight_version,
        }

    def _running_ids(self) -> list[str]:
        return [rid for rid, context in self._in_flight.items() if not context.is_stopped()]

    async def _pause(self, body: Body) -> Body:
        pause = controls.parse_pause(body)
        ending = self._running_ids() if pause.mode == "abort" else []
        await self._require_llm().pause_generation(mode=pause.mode, clear_cache=pause.clear_cache)
        return controls.paused(pause.mode, ending)

    async def _resume(self, body: Body) -> Body:
        if self._sleep_tags:
            return controls.resumed(True)
        await self._require_llm().resume_generation()
        return controls.resumed(False)

    async def _is_paused(self, body: Body) -> Body:
        return controls.pause_state(bool(await self._require_llm().is_paused()))

    async def _sleep(self, body: Body) -> Body:
        sleep = controls.parse_sleep(body)
        llm = self._require_llm()
        ending = self._running_ids() if sleep.mode == "abort" and not self._sleep_tags else []
        if not self._sleep_tags:
            self._sleep_level = sleep.level
            await llm.sleep(level=sleep.level, mode=sleep.mode)
        self._sleep_tags |= sleep.tags
        answer = controls.sleeping(self._sleep_level, self._sleep_tags, ending)
        if self.on_cpu:
            answer["freed"] = []
            answer["message"] = CPU_SLEEP_NOTE
        else:
            answer["freed"] = sorted(self._sleep_tags)
        return answer

    async def _wake_up(self, body: Body) -> Body:
        wake = controls.parse_wake(body)
        if not self._sleep_tags:
            return controls.woke(())
        remaining = self._sleep_tags - wake.tags
        llm = self._require_llm()
        if not remaining:
            # Level 0 only paused the scheduler: vLLM wakes that as "scheduling".
            await llm.wake_up(None if self._sleep_level >= 1 else ["scheduling"])
            await llm.resume_generation()
        elif not self.on_cpu:
            await llm.wake_up(sorted(self._sleep_tags & wake.tags))
        self._sleep_tags = remaining
        return controls.woke(remaining)

    async def _is_sleeping(self, body: Body) -> Body:
        return controls.sleep_state(self._sleep_tags)

    async def _abort_request(self, body: Body) -> Body:
        wanted = controls.parse_abort(body)
        ids = [rid for rid in self._running_ids() if wanted.matches(rid)]
        if ids:
            await self._require_llm().abort(ids)
        return controls.aborted(ids)

    async def _flush_cache(self, body: Body) -> Body:
        if not await self._require_llm().reset_prefix_cache():
            raise ControlRejected(
                "vLLM did not reset its prefix cache: requests are running; pause "
                "generation (or let them finish) first"
            )
        return controls.flushed()

    async def _get_weight_version(self, body: Body) -> Body:
        version = await self._require_llm().get_weight_version()
        return {"weight_version": version, "version": version}
