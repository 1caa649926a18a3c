"""RL admin helpers: request validation for RL clients and the RL route registry.

The registry is what a trainer discovers: the names of the admin routes this process
serves (as ``/engine/<name>``). Its request-plane ``dispatch`` only ever describes the
routes; executing them is the HTTP admin plane's job (``penstock.routers.admin``).

Seed parity: ``env_bool``, ``TRUE_ENV_VALUES``, ``first_endpoint_response`` and
``RLRouteRegistry.dispatch`` / ``dispatch_stream`` are the ``dynamo.common.rl`` API for code
written against Dynamo; the gateway does not call them itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from penstock.errors import RLAdminValidationError

TRUE_ENV_VALUES = frozenset({"1", "true", "yes", "on"})

RLRouteHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]

_OK: dict[str, Any] = {"status": "ok"}


def env_bool(name: str, default: bool = False) -> bool:
    """``name`` read as a boolean flag; unset means ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in TRUE_ENV_VALUES


async def first_endpoint_response(gen_fn: Callable[[Any], Any], body: Any) -> dict[str, Any]:
    """The first item an endpoint's async generator yields (``{"status": "ok"}`` if none).

    The generator is always closed, so an endpoint that would keep streaming is not left
    suspended.
    """
    agen = gen_fn(body)
    try:
        async for item in agen:
            return item if item else dict(_OK)
        return dict(_OK)
    finally:
        await agen.aclose()


def _require_lora_name(req: Mapping[str, Any]) -> str:
    name = req.get("lora_name")
    if not isinstance(name, str) or not name:
        raise RLAdminValidationError("'lora_name' is required and must be a string")
    return name


def require_lora_load_request(req: Any) -> tuple[str, str]:
    """``(lora_name, source.uri)`` of a load request; never coerces other types to text."""
    if not isinstance(req, Mapping):
        raise RLAdminValidationError("Request is required with 'lora_name' and 'source.uri'")
    name = _require_lora_name(req)
    source = req.get("source")
    if not isinstance(source, Mapping):
        raise RLAdminValidationError("'source' object is required in request")
    uri = source.get("uri")
    if not isinstance(uri, str) or not uri:
        raise RLAdminValidationError("'source.uri' is required and must be a string")
    return name, uri


def require_lora_unload_request(req: Any) -> str:
    """``lora_name`` of an unload request."""
    if not isinstance(req, Mapping):
        raise RLAdminValidationError("Request is required with 'lora_name' field")
    return _require_lora_name(req)


def _validate_world_size(world_size: Any) -> int | None:
    if world_size is None:
        return None
    # bool is an int subclass; a flag is never a valid world size.
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return world_size


class RLRouteRegistry:
    """Registry for worker RL admin route descriptors.

    ``runtime`` is anything with ``system_status_server_url() -> str | None``: the base URL
    trainers reach the admin routes at.
    """

    def __init__(
        self,
        runtime: Any,
        *,
        logger_: logging.Logger | None = None,
        world_size: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.logger = logger_ or logging.getLogger(__name__)
        self.world_size = _validate_world_size(world_size)
        self.routes: dict[str, RLRouteHandler] = {}

    def add_route(self, name: str, handler: RLRouteHandler) -> None:
        if name in self.routes:
            self.logger.debug("RL route %s replaced", name)
        self.routes[name] = handler

    def add_routes(self, routes: Mapping[str, RLRouteHandler]) -> None:
        for name, handler in routes.items():
            self.add_route(name, handler)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"status": "ok", "routes": sorted(self.routes)}
        url_of = getattr(self.runtime, "system_status_server_url", None)
        url = url_of() if callable(url_of) else None
        if url:
            described["system_url"] = url
        if self.world_size is not None:
            described["world_size"] = self.world_size
        return described

    def dispatch(self, request: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Answer a request-plane RL call; only ``method="routes"`` exists (describe)."""
        if not isinstance(request, Mapping):
            return {"status": "error", "message": "rl_dispatch: request required"}
        method = request.get("method")
        if not isinstance(method, str) or not method:
            return {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}
        if method != "routes":
            return {
                "status": "error",
                "method": method,
                "message": "rl request-plane endpoint only supports method='routes'",
            }
        kwargs = request.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            return {
                "status": "error",
                "method": method,
                "message": "rl_dispatch: 'kwargs' must be an object",
            }
        return self.describe()

    async def dispatch_stream(
        self, request: Mapping[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        yield self.dispatch(request)
