"""The RL admin routes (``/engine/<name>``): bodies and responses in the RL clients' shapes.

Each handler takes the JSON body (already checked to be an object) and returns the
response object, or raises a :class:`penstock.errors.PenstockError` (400 bad field,
409 invalid state, ...). Every success carries ``"status": "ok"`` (``"success"`` for the
LoRA routes) and ``"state"``, the admin state after the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from penstock.errors import InvalidRequestError, RLAdminValidationError
from penstock.rl.admin import (
    RLRouteHandler,
    require_lora_load_request,
    require_lora_unload_request,
)
from penstock.rl.fields import (
    bool_field,
    from_validation,
    mode_field,
    required_str,
    str_field,
)

if TYPE_CHECKING:
    from penstock.lora.adapters import LoadedAdapters
    from penstock.rl.state import AdminStateMachine
    from penstock.rl.weights import WeightsChecker

# Knobs of the RL request itself, not of the engine's update call.
_DISTRIBUTED_FLAGS = ("allow_unpaused", "reset_prefix_cache", "weight_version")


class RLRoutes:
    def __init__(
        self,
        admin: AdminStateMachine,
        adapters: LoadedAdapters,
        checker: WeightsChecker,
        *,
        alive: Callable[[], bool],
    ) -> None:
        self.admin = admin
        self.adapters = adapters
        self.checker = checker
        self.alive = alive

    def handlers(self) -> dict[str, RLRouteHandler]:
        return {
            "liveness_probe": self.liveness_probe,
            "pause_generation": self.pause_generation,
            "resume_generation": self.resume_generation,
            "flush_cache": self.flush_cache,
            "abort_request": self.abort_request,
            "update_weights_from_disk": self.update_weights_from_disk,
            "update_weights_from_distributed": self.update_weights_from_distributed,
            "update_weights_from_tensor": self.update_weights_from_tensor,
            "update_weights_from_nixl": self.update_weights_from_nixl,
            "init_weights_update_group": self.init_weights_update_group,
            "destroy_weights_update_group": self.destroy_weights_update_group,
            "get_weight_version": self.get_weight_version,
            "set_weight_version": self.set_weight_version,
            "load_lora": self.load_lora,
            "unload_lora": self.unload_lora,
            "weights_checker": self.weights_checker,
            "get_weights_by_name": self.get_weights_by_name,
        }

    def _ok(self, **fields: Any) -> dict[str, Any]:
        return {"status": "ok", **fields, "state": self.admin.name}

    def _version(self) -> dict[str, Any]:
        return {
            "version": self.admin.weight_version,
            "version_declared": self.admin.version_declared,
        }

    async def liveness_probe(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.alive():
            return self._ok(alive=True)
        return {"status": "error", "alive": False, "message": "engine is not running"}

    async def pause_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = mode_field(body, "mode", "keep")
        clear_cache = bool_field(body, "clear_cache", False)
        outcome = await self.admin.pause(mode, clear_cache)
        return self._ok(
            message="Engine paused",
            mode=mode,
            clear_cache=clear_cache,
            changed=outcome.changed,
            aborted=outcome.engine.get("aborted", []),
        )

    async def resume_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        outcome = await self.admin.resume()
        return self._ok(message="Engine resumed", changed=outcome.changed)

    async def flush_cache(self, body: dict[str, Any]) -> dict[str, Any]:
        result = await self.admin.run_control("flush_cache", {})
        return self._ok(message="Cache flushed", flushed_entries=result.get("flushed_entries"))

    async def abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        request_id = body.get("request_id")
        if request_id is None:
            raise InvalidRequestError(
                "Missing 'request_id' in body", param="request_id", code="invalid_value"
            )
        request_id = required_str(body, "request_id")
        result = await self.admin.run_control("abort_request", {"request_id": request_id})
        return self._ok(request_id=request_id, aborted=request_id in result.get("aborted", []))

    async def get_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._ok(**self._version())

    async def set_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("weight_version") is None:
            raise InvalidRequestError(
                "Missing 'weight_version' in body", param="weight_version", code="invalid_value"
            )
        version = required_str(body, "weight_version")
        await self.admin.set_weight_version(version)
        return self._ok(version=version)

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        model_path = required_str(body, "model_path")
        version = str_field(body, "weight_version")
        update_body: dict[str, Any] = {"model_path": model_path}
        if version is not None:
            update_body["weight_version"] = version
        outcome = await self.admin.update_weights(
            "update_weights_from_disk", update_body, version, param="model_path"
        )
        return self._ok(**self._version(), checksum=outcome.engine.get("checksum"))

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        allow_unpaused = bool_field(body, "allow_unpaused", False)
        reset_prefix_cache = bool_field(body, "reset_prefix_cache", True)
        if allow_unpaused and reset_prefix_cache:
            raise InvalidRequestError(
                "'allow_unpaused' cannot be combined with 'reset_prefix_cache'",
                param="allow_unpaused",
                code="invalid_value",
            )
        if allow_unpaused:
            raise InvalidRequestError(
                "'allow_unpaused' is not supported: weight updates need the paused state",
                param="allow_unpaused",
                code="invalid_value",
            )
        version = str_field(body, "weight_version")
        update_body = {k: v for k, v in body.items() if k not in _DISTRIBUTED_FLAGS}
        if version is not None:
            update_body["weight_version"] = version
        outcome = await self.admin.update_weights(
            "update_weights_from_distributed", update_body, version
        )
        if reset_prefix_cache and self.admin.supports("control", "flush_cache"):
            await self.admin.run_control("flush_cache", {})
        return self._ok(**self._version(), checksum=outcome.engine.get("checksum"))

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        version = str_field(body, "weight_version")
        outcome = await self.admin.update_weights(
            "update_weights_from_tensor", dict(body), version, param="serialized_named_tensors"
        )
        return self._ok(**self._version(), checksum=outcome.engine.get("checksum"))

    async def update_weights_from_nixl(self, body: dict[str, Any]) -> dict[str, Any]:
        version = str_field(body, "weight_version")
        outcome = await self.admin.update_weights(
            "update_weights_from_nixl", dict(body), version, param="descriptors"
        )
        return self._ok(**self._version(), checksum=outcome.engine.get("checksum"))

    async def weights_checker(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._ok(**await self.checker.run(body))

    async def get_weights_by_name(self, body: dict[str, Any]) -> dict[str, Any]:
        name = required_str(body, "name")
        truncate = body.get("truncate_size", 100)
        result = await self.admin.run_control(
            "get_weights_by_name", {"name": name, "truncate_size": truncate}, param="name"
        )
        return self._ok(**{k: v for k, v in result.items() if k != "status"})

    async def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        result = await self.admin.run_update("init_weights_update_group", body)
        return self._ok(message=result.get("message", "Weights update group initialized"))

    async def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        result = await self.admin.run_update("destroy_weights_update_group", body)
        return self._ok(message=result.get("message", "Weights update group destroyed"))

    async def load_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            name, uri = require_lora_load_request(body)
        except RLAdminValidationError as exc:
            field = "source.uri" if "source" in str(exc) else "lora_name"
            raise from_validation(exc, field) from exc
        adapter, changed = await self.adapters.load(name, uri, field="source.uri")
        return {
            "status": "success",
            "message": f"LoRA adapter '{name}' loaded" if changed else "already loaded",
            **adapter.describe(),
            "changed": changed,
        }

    async def unload_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            name = require_lora_unload_request(body)
        except RLAdminValidationError as exc:
            raise from_validation(exc, "lora_name") from exc
        adapter = await self.adapters.unload(name)
        return {
            "status": "success",
            "message": f"LoRA adapter '{name}' unloaded",
            "lora_name": name,
            "lora_id": adapter.info.id,
        }
