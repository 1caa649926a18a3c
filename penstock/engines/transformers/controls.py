"""The transformers engine's lifecycle controls: pause, sleep, wake, abort, flush.

Bodies and answers are those of :mod:`penstock.engines.controls`. A pause in ``abort``
mode cancels every request in flight, ``wait`` returns once they finished, ``keep``
freezes them with their KV. A sleep holds generation like a pause and releases its tags:
at level 1 released weights and KV move to the host, at level 2 the weights are dropped
(``wake_up`` reloads the checkpoint last read from disk), at level 0 nothing moves. A
wake restores the tags it names; generation runs again once no tag is released, and the
sleep's own pause ends with it. ``flush_cache`` forgets the cached prefixes and image
features (both only save work). ``abort_request`` cancels the named requests, or every one
in flight (``abort_all``); they end with what they produced and ``finish_reason``
``"cancelled"``, which the gateway reports as ``"abort"``.
"""

from __future__ import annotations

import asyncio
import gc
from typing import TYPE_CHECKING, Any

import torch

from penstock.engines import controls
from penstock.engines.controls import Body, Handler
from penstock.engines.transformers.weights.checkpoint import (
    apply_weight_update,
    plan_weight_update,
    read_safetensors,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from penstock.engines.transformers.args import EngineArgs
    from penstock.engines.transformers.core.scheduler import BatchScheduler, Submission
    from penstock.engines.transformers.features.lora import AdapterSet
    from penstock.engines.transformers.features.vision import VisionEncoder


class TransformersControls:
    """Pause, sleep and abort over the batch scheduler (mixed into the engine)."""

    args: EngineArgs
    model: Any
    model_path: Path
    device: torch.device | None
    dtype: torch.dtype | None
    scheduler: BatchScheduler | None
    lora: AdapterSet
    vision: VisionEncoder | None
    _load_model: Callable[..., Any]
    _weights_source: Path | None
    _require_scheduler: Callable[[], BatchScheduler]
    _install_forward_module: Callable[[BatchScheduler], None]

    def __init__(self) -> None:
        # Tags released by a sleep (see SLEEP_TAGS), and whether that sleep paused.
        self._sleeping: set[str] = set()
        self._paused_by_sleep = False
        # The requests in generate, canaries aside: what abort_all ends.
        self._in_flight: set[Submission] = set()

    def lifecycle_controls(self) -> dict[str, Handler]:
        return {
            controls.PAUSE: self._pause_generation,
            controls.RESUME: self._resume_generation,
            controls.IS_PAUSED: self._is_paused,
            controls.IS_SLEEPING: self._is_sleeping,
            controls.SLEEP: self._sleep,
            controls.WAKE_UP: self._wake_up,
            controls.FLUSH_CACHE: self._flush_cache,
            controls.ABORT_REQUEST: self._abort_request,
        }

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        if self.device is None or self.dtype is None:
            raise RuntimeError("the transformers engine is not started")
        return self.device, self.dtype

    async def _pause(self, mode: str) -> list[str]:
        """Pause in ``mode``; the ids of the requests an ``abort`` pause ended."""
        scheduler = self._require_scheduler()
        in_flight = await asyncio.to_thread(
            scheduler.pause, abort=mode == "abort", freeze=mode == "keep"
        )
        if mode != "keep":
            await asyncio.to_thread(scheduler.wait_until_done, in_flight)
        return [s.request_id for s in in_flight] if mode == "abort" else []

    async def _pause_generation(self, body: Body) -> Body:
        pause = controls.parse_pause(body)
        aborted = await self._pause(pause.mode)
        if pause.clear_cache:
            await self._flush_cache({})
        return controls.paused(pause.mode, aborted)

    async def _resume_generation(self, body: Body) -> Body:
        self._require_scheduler().resume()
        self._paused_by_sleep = False
        return controls.resumed(bool(self._sleeping))

    async def _is_paused(self, body: Body) -> Body:
        return controls.pause_state(self._require_scheduler().paused)

    async def _is_sleeping(self, body: Body) -> Body:
        return controls.sleep_state(self._sleeping)

    async def _sleep(self, body: Body) -> Body:
        sleep = controls.parse_sleep(body)
        scheduler = self._require_scheduler()
        aborted: list[str] = []
        if not self._sleeping:
            was_paused = scheduler.paused
            aborted = await self._pause(sleep.mode)
            self._paused_by_sleep = not was_paused
            await asyncio.to_thread(scheduler.set_sleeping, True)
        released = set(sleep.tags) - self._sleeping
        await asyncio.to_thread(self._release_memory, sleep.level, released)
        self._sleeping |= released
        return controls.sleeping(sleep.level, self._sleeping, aborted)

    def _release_memory(self, level: int, tags: set[str]) -> None:
        """Level 1 moves ``tags`` to the host; level 2 drops the weights too."""
        if level == 0 or not tags:
            return
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            if "kv_cache" in tags:
                scheduler.move_kv(torch.device("cpu"))
            if "weights" in tags and level == 1 and self.model is not None:
                self.model.to("cpu")
            elif "weights" in tags and level == 2:
                self.model = None
                self.lora.forget_model()
                scheduler.model = None
                scheduler.decoder = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore_weights(self) -> None:
        scheduler = self._require_scheduler()
        device, dtype = self._placement()
        if self.model is None:
            model = self._load_model(self.model_path, dtype=dtype, device=device)
            if self._weights_source is not None:
                apply_weight_update(
                    plan_weight_update(model, read_safetensors(self._weights_source))
                )
            self.lora.reattach(model)
            self.model = model
        else:
            self.model.to(device)
        with scheduler.step_lock:
            self._install_forward_module(scheduler)

    def _restore_kv(self) -> None:
        scheduler = self._require_scheduler()
        device, _ = self._placement()
        with scheduler.step_lock:
            scheduler.move_kv(device)

    async def _wake_up(self, body: Body) -> Body:
        wake = controls.parse_wake(body)
        if not self._sleeping:
            return controls.woke(())
        if "weights" in wake.tags & self._sleeping:
            await asyncio.to_thread(self._restore_weights)
            self._sleeping.discard("weights")
        if "kv_cache" in wake.tags & self._sleeping:
            await asyncio.to_thread(self._restore_kv)
            self._sleeping.discard("kv_cache")
        if not self._sleeping:
            scheduler = self._require_scheduler()
            scheduler.set_sleeping(False)
            if self._paused_by_sleep:
                scheduler.resume()
                self._paused_by_sleep = False
        return controls.woke(self._sleeping)

    async def _flush_cache(self, body: Body) -> Body:
        # Cached prefixes are forgotten; KV of running sequences stays. The allocator's
        # idle blocks go back to the device.
        await asyncio.to_thread(self._require_scheduler().reset_prefix_cache)
        if self.vision is not None:
            self.vision.forget()
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return controls.flushed()

    async def _abort_request(self, body: Body) -> Body:
        wanted = controls.parse_abort(body)
        scheduler = self._require_scheduler()
        ended = [s for s in self._in_flight if not s.done and wanted.matches(s.request_id)]
        for submission in ended:
            scheduler.cancel(submission)
        return controls.aborted({s.request_id for s in ended})
