"""LoRA adapters on the transformers engine: ``load_lora`` / ``unload_lora`` and the
adapter a request's ``model`` names (mixed into the engine).

Adapters are injected with peft (:mod:`.features.lora`) between decode steps, under the
scheduler's step lock. An adapter being unloaded, or unloaded, is refused by name, never
served by the base model in its place; an unload waits for the requests already running
with it, and is refused while those cannot move (generation paused or asleep).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from penstock.engines.controls import Body, ControlRejected
from penstock.engines.transformers.core.scheduler import BatchScheduler
from penstock.engines.transformers.features.lora import (
    BASE_ROW,
    AdapterSet,
    LoraAdapter,
    LoraError,
    read_adapter,
)

logger = logging.getLogger(__name__)


class TransformersLoraControls:
    """LoRA load, unload and per-request selection (mixed into the engine)."""

    model: Any
    served_model_name: str
    _sleeping: set[str]
    _require_scheduler: Callable[[], BatchScheduler]
    _install_forward_module: Callable[[BatchScheduler], None]

    def __init__(self) -> None:
        self.lora = AdapterSet()
        self._unloading: set[str] = set()
        self._retired: set[str] = set()

    def _adapter_for(self, model: Any) -> str | None:
        """peft's key of the adapter ``model`` names; None for the base model."""
        if model is None or model == self.served_model_name:
            return None
        if not isinstance(model, str):
            raise ValueError(f"model: must be a string, got {type(model).__name__}")
        if model in self.lora and model not in self._unloading:
            return self.lora.adapters[model].key
        if model in self._unloading or model in self._retired:
            loaded = ", ".join(sorted(set(self.lora.adapters) - self._unloading)) or "none"
            raise ValueError(f"model: LoRA adapter {model!r} is not loaded (loaded: {loaded})")
        # The gateway has resolved every other name to the base model: it may serve the base
        # under names of its own (--served-model-name, aliases), and 404s unknown names.
        return None

    async def _load_lora(self, body: Body) -> Body:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ControlRejected("missing non-empty `lora_name` string")
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ControlRejected("missing non-empty `lora_path` string")
        if name in (self.served_model_name, BASE_ROW):
            raise ControlRejected(f"`lora_name` {name!r} is reserved for the base model")
        if name in self.lora:
            loaded_from = self.lora.adapters[name].path
            raise ControlRejected(
                f"LoRA adapter '{name}' is already loaded from {loaded_from}; unload it first"
            )
        if self.model is None:
            raise ControlRejected(
                "the weights are asleep: call wake_up before loading a LoRA adapter"
            )
        try:
            adapter = await asyncio.to_thread(read_adapter, name, self.lora.next_key(), Path(path))
            await asyncio.to_thread(self._attach, adapter)
        except LoraError as exc:
            raise ControlRejected(f"LoRA adapter '{name}' not loaded: {exc}") from exc
        self._retired.discard(name)
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return {
            "status": "ok",
            "message": f"LoRA adapter '{name}' loaded",
            "lora_name": name,
            "lora_path": path,
        }

    def _attach(self, adapter: LoraAdapter) -> None:
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            self.lora.attach(self.model, adapter)
            self._install_forward_module(scheduler)

    async def _unload_lora(self, body: Body) -> Body:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ControlRejected("missing non-empty `lora_name` string")
        if name not in self.lora or name in self._unloading:
            loaded = ", ".join(sorted(self.lora.adapters)) or "none"
            raise ControlRejected(f"LoRA adapter '{name}' is not loaded (loaded: {loaded})")
        scheduler = self._require_scheduler()
        key = self.lora.adapters[name].key
        self._unloading.add(name)
        try:
            in_flight = scheduler.unfinished_with_adapter(key)
            # Requests that can't move while generation is paused or asleep would hold the
            # unload forever; cancelled ones end at the next scheduler pass regardless.
            stuck = [s for s in in_flight if not s.should_stop()]
            if stuck and (scheduler.paused or self._sleeping):
                raise ControlRejected(
                    f"LoRA adapter '{name}' has {len(stuck)} request(s) in flight while "
                    "generation is paused; resume generation or abort them, then unload it"
                )
            # Requests already running with the adapter finish with it.
            await asyncio.to_thread(scheduler.wait_until_done, in_flight)
            await asyncio.to_thread(self._detach, name)
            self._retired.add(name)
        finally:
            self._unloading.discard(name)
        logger.info("LoRA adapter %r unloaded", name)
        return {"status": "ok", "message": f"LoRA adapter '{name}' unloaded", "lora_name": name}

    def _detach(self, name: str) -> None:
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            self.lora.detach(name)
            self._install_forward_module(scheduler)
