"""LoRA adapters across a Ray fleet: registered once at the ingress, loaded on each replica
where requests for them are routed.

``/v1/load_lora_adapter`` (and the other LoRA admin routes) reach the fleet as the
engine's ``load_lora`` / ``unload_lora`` updates (:mod:`penstock.lora.adapters`), so
adapters are listed and resolved as models exactly as in one process. Under ``--ray``:

* ``load_lora`` loads the adapter on one replica (the least-loaded one), so a bad
  adapter is refused with the engine's 400 before it is listed, then registers its name
  and path in :class:`FleetAdapters`.
* A request for an adapter carries ``(name, path)`` to its replica; a replica that has
  not loaded it yet loads it first (:class:`ReplicaAdapters`), so every replica, one
  started later by autoscaling or to replace a lost one included, can serve it.
* ``unload_lora`` removes the name (no new request is sent for it) and unloads it on every
  replica that has it.

The path is the one the ingress fetched the adapter to: every node must be able to read
it (a local folder on shared storage, or the same LoRA cache path on every node).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from penstock.errors import InternalServerError, InvalidRequestError, PenstockError
from penstock.ray.wire import entry_error

logger = logging.getLogger(__name__)

LORA_UPDATES = frozenset({"load_lora", "unload_lora"})


def engine_refusal(update: str, exc: Exception) -> PenstockError:
    """What the admin plane makes of an engine update's exception (see ``rl.state``)."""
    if isinstance(exc, PenstockError):
        return exc
    if isinstance(exc, ValueError | TypeError):
        return InvalidRequestError(f"{update}: {exc}", param="lora_path", code="engine_rejected")
    return InternalServerError(f"engine update '{update}' failed")


class ReplicaAdapters:
    """The adapters one replica's engine has loaded, loading each at most once at a time."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.loaded: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` unless it is loaded from there already."""
        if self.loaded.get(name) == path:
            return
        async with self._locks.setdefault(name, asyncio.Lock()):
            if self.loaded.get(name) == path:
                return
            if name in self.loaded:
                await self._call("unload_lora", {"lora_name": name})
                del self.loaded[name]
            result = await self._call("load_lora", {"lora_name": name, "lora_path": path})
            if isinstance(result, dict) and result.get("status") == "error":
                raise InvalidRequestError(
                    str(result.get("message") or "load_lora failed"),
                    param="lora_path",
                    code="engine_rejected",
                )
            self.loaded[name] = path

    async def unload(self, name: str) -> bool:
        """Unload ``name`` if this replica has it; whether it had."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            if self.loaded.pop(name, None) is None:
                return False
            await self._call("unload_lora", {"lora_name": name})
            return True

    async def _call(self, update: str, body: dict[str, Any]) -> Any:
        try:
            return await self._engine.engine_update(update, body)
        except Exception as exc:
            if not isinstance(exc, PenstockError | ValueError | TypeError):
                logger.exception("engine update %s failed", update)
            raise engine_refusal(update, exc) from exc


class FleetAdapters:
    """The ingress's registry: which adapter names the fleet serves, from which path."""

    def __init__(self, handle: Any, offered: set[str]) -> None:
        self._handle = handle
        self.updates = set(LORA_UPDATES & offered)
        self.paths: dict[str, str] = {}

    def route(self, model: str | None) -> tuple[str, str] | None:
        """``(name, path)`` when ``model`` names a registered adapter."""
        path = self.paths.get(model or "")
        return None if path is None else (str(model), path)

    async def update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("lora_name"))
        if update == "load_lora":
            path = str(body.get("lora_path"))
            refusal = entry_error(await self._handle.load_adapter.remote(name, path))
            if refusal is not None:
                raise refusal
            self.paths[name] = path
            return {"status": "ok", "lora_name": name}
        self.paths.pop(name, None)
        replies = await self._handle.broadcast("unload_adapter", name).results_async(
            return_exceptions=True
        )
        failed = [reply for reply in replies if isinstance(reply, BaseException)]
        for reply in failed:
            logger.warning("unloading LoRA adapter %s on a replica failed: %s", name, reply)
        return {"status": "ok", "lora_name": name, "replicas": len(replies) - len(failed)}
