"""The LoRA adapters one gateway serves: fetched, loaded into the engine, listed as models.

A loaded adapter is a served model of its own name (``/v1/models`` lists it with its
``parent``); a request whose ``model`` names it reaches the engine with that ``model``,
which is how the engine picks the adapter. The engine side of the contract:

* ``engine_update("load_lora", {"lora_name": str, "lora_path": <local folder>})``
* ``engine_update("unload_lora", {"lora_name": str})``

An engine that does not list ``load_lora`` in ``supported_updates()`` gets a 400.

Reloading a name in place (``in_place``; vLLM's ``load_inplace``, RL trainers that load one
name from a new folder every step) never swaps weights under a running request: the new
folder loads into the engine under the name's other slot (:data:`RELOAD_SLOT_SUFFIX`), and
only then does the served name point at it, so every request from then on gets the new
adapter. The replaced adapter stays loaded for the requests that began with it (those
still queued in the gateway included) until the next reload needs its slot, when the
engine unloads it once they have ended. A load that fails leaves the old adapter served.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from penstock.errors import ConflictError, InvalidRequestError, NotFoundError, clip
from penstock.gateway import ServedModel
from penstock.lora.manager import LoRAInfo, LoRAManager

if TYPE_CHECKING:
    from penstock.gateway import Gateway
    from penstock.rl.state import AdminStateMachine

# The engine-side name an adapter alternates to on each in-place reload.
RELOAD_SLOT_SUFFIX = "#reloaded"


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    source: str
    info: LoRAInfo
    # The name the engine knows it by: ``name``, or its other slot after an in-place reload.
    engine_name: str

    def describe(self) -> dict[str, Any]:
        return {
            "lora_name": self.name,
            "lora_id": self.info.id,
            "local_path": self.info.path,
            "source": self.source,
        }


def source_uri(source: str) -> str:
    """A URI for ``source``: URIs pass through, a plain path becomes ``file://<abs>``."""
    if "://" in source:
        return source
    return Path(source).expanduser().resolve().as_uri()


class LoadedAdapters:
    def __init__(
        self, gateway: Gateway, admin: AdminStateMachine, manager: LoRAManager | None = None
    ) -> None:
        self.gateway = gateway
        self.admin = admin
        self.manager = manager or LoRAManager()
        self.adapters: dict[str, LoadedAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        # Engine slots of replaced adapters, still loaded for the requests that use them.
        self._replaced: set[str] = set()

    @property
    def supported(self) -> bool:
        return self.admin.supports("update", "load_lora")

    def _base_model(self) -> ServedModel:
        for model in self.gateway.listed_models():
            if model.lora_adapter is None and model.host is self.gateway.host:
                return model
        raise InvalidRequestError("no base model is served to attach a LoRA adapter to")

    async def load(
        self, name: str, source: str, *, field: str, in_place: bool = False
    ) -> tuple[LoadedAdapter, bool]:
        """Load ``source`` as ``name``; ``(adapter, changed)``. A repeat of a loaded name and
        source changes nothing unless ``in_place``, which reads the folder again; another
        source for a loaded name is a 409 unless ``in_place``."""
        if not self.supported:
            raise InvalidRequestError(
                "this engine does not support LoRA adapters (it offers no 'load_lora' update)",
                param="lora_name",
                code="lora_unsupported",
            )
        uri = source_uri(source)
        async with self._lock:
            existing = self.adapters.get(name)
            if existing is None:
                if name in self.gateway.models:
                    raise ConflictError(
                        f"'{clip(name)}' is already a served model name", param="lora_name"
                    )
                adapter = await self._load_slot(name, name, uri, field, next(self._ids))
            elif in_place:
                slot = self._other_slot(existing)
                await self._unload_replaced(slot)
                # The name keeps its id across reloads, as in vLLM.
                adapter = await self._load_slot(name, slot, uri, field, existing.info.id)
            elif existing.source == uri:
                return existing, False
            else:
                raise ConflictError(
                    f"LoRA adapter '{clip(name)}' is already loaded from {existing.source}; "
                    "unload it first, or reload it in place (load_inplace: true)",
                    param="lora_name",
                )
            self._serve(adapter)
            self.adapters[name] = adapter
            if existing is not None:
                self._replaced.add(existing.engine_name)
            return adapter, True

    def _other_slot(self, adapter: LoadedAdapter) -> str:
        slot = adapter.name + RELOAD_SLOT_SUFFIX
        if adapter.engine_name != adapter.name:
            return adapter.name
        if slot in self.gateway.models:
            raise ConflictError(
                f"LoRA adapter '{clip(adapter.name)}' cannot be reloaded in place: its reload "
                f"slot '{clip(slot)}' is a served model name",
                param="lora_name",
            )
        return slot

    async def _load_slot(
        self, name: str, slot: str, uri: str, field: str, lora_id: int
    ) -> LoadedAdapter:
        fetched = await self.manager.download_lora(uri)
        if fetched.get("status") != "success":
            raise InvalidRequestError(str(fetched.get("message")), param=field)
        local_path = str(fetched["local_path"])
        await self.admin.run_update("load_lora", {"lora_name": slot, "lora_path": local_path})
        return LoadedAdapter(name, uri, LoRAInfo(lora_id, local_path), slot)

    def _serve(self, adapter: LoadedAdapter) -> None:
        """Point the served name at ``adapter``: requests from now on reach the engine
        with its engine name (a request's ``model`` is its served model's ``name``)."""
        base = self._base_model()
        self.gateway.models[adapter.name] = ServedModel(
            name=adapter.engine_name,
            host=self.gateway.host,
            preprocessor=base.preprocessor,
            endpoint_types=set(base.endpoint_types),
            lora_adapter=adapter.info.path,
            tool_call_parser=base.tool_call_parser,
            reasoning_parser=base.reasoning_parser,
        )

    async def _unload_replaced(self, slot: str) -> None:
        """Unload a replaced adapter's slot, once its requests have ended; the engine's
        refusal (requests still running with it while paused) is the caller's error."""
        if slot in self._replaced:
            await self.admin.run_update("unload_lora", {"lora_name": slot})
            self._replaced.discard(slot)

    async def unload(self, name: str) -> LoadedAdapter:
        async with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                loaded = ", ".join(sorted(self.adapters)) or "none"
                raise NotFoundError(
                    f"LoRA adapter '{clip(name)}' is not loaded (loaded: {loaded})",
                    param="lora_name",
                    code="lora_not_found",
                )
            for slot in (name, name + RELOAD_SLOT_SUFFIX):
                if slot != adapter.engine_name:
                    await self._unload_replaced(slot)
            await self.admin.run_update("unload_lora", {"lora_name": adapter.engine_name})
            self.gateway.models.pop(name, None)
            del self.adapters[name]
            return adapter

    def listing(self) -> list[dict[str, Any]]:
        return [adapter.describe() for adapter in self.adapters.values()]
