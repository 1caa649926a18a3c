"""The LoRA adapters one gateway serves: fetched, loaded into the engine, listed as models.

A loaded adapter is a served model of its own name (``/v1/models`` lists it with its
``parent``); a request whose ``model`` names it reaches the engine with that ``model``,
which is how the engine picks the adapter. The engine side of the contract:

* ``engine_update("load_lora", {"lora_name": str, "lora_path": <local folder>})``
* ``engine_update("unload_lora", {"lora_name": str})``

An engine that does not list ``load_lora`` in ``supported_updates()`` gets a 400.
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


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    source: str
    info: LoRAInfo

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

    @property
    def supported(self) -> bool:
        return self.admin.supports("update", "load_lora")

    def _base_model(self) -> ServedModel:
        for model in self.gateway.listed_models():
            if model.lora_adapter is None and model.host is self.gateway.host:
                return model
        raise InvalidRequestError("no base model is served to attach a LoRA adapter to")

    async def load(self, name: str, source: str, *, field: str) -> tuple[LoadedAdapter, bool]:
        """Load ``source`` as ``name``; ``(adapter, changed)``, unchanged on a repeat."""
        if not self.supported:
            raise InvalidRequestError(
                "this engine does not support LoRA adapters (it offers no 'load_lora' update)",
                param="lora_name",
                code="lora_unsupported",
            )
        uri = source_uri(source)
        async with self._lock:
            existing = self.adapters.get(name)
            if existing is not None:
                if existing.source == uri:
                    return existing, False
                raise ConflictError(
                    f"LoRA adapter '{clip(name)}' is already loaded from {existing.source}; "
                    "unload it first",
                    param="lora_name",
                )
            if name in self.gateway.models:
                raise ConflictError(
                    f"'{clip(name)}' is already a served model name", param="lora_name"
                )
            fetched = await self.manager.download_lora(uri)
            if fetched.get("status") != "success":
                raise InvalidRequestError(str(fetched.get("message")), param=field)
            local_path = str(fetched["local_path"])
            await self.admin.run_update("load_lora", {"lora_name": name, "lora_path": local_path})
            adapter = LoadedAdapter(name, uri, LoRAInfo(next(self._ids), local_path))
            base = self._base_model()
            self.gateway.add_model(
                ServedModel(
                    name=name,
                    host=self.gateway.host,
                    preprocessor=base.preprocessor,
                    endpoint_types=set(base.endpoint_types),
                    lora_adapter=local_path,
                )
            )
            self.adapters[name] = adapter
            return adapter, True

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
            await self.admin.run_update("unload_lora", {"lora_name": name})
            self.gateway.remove_model(name)
            del self.adapters[name]
            return adapter

    def listing(self) -> list[dict[str, Any]]:
        return [adapter.describe() for adapter in self.adapters.values()]
