"""The engine admin plane: ``/engine/*`` routes for RL trainers and operators.

Routes
  ``GET /engine/capabilities``
      ``{"object": "engine.capabilities", "engine", "controls", "updates", "rl_routes",
      "system_url", "state": {...}, "weight_version", "lora": {"supported", "loaded",
      "schemes"}, "deterministic", "dialects": {"sglang": [paths], "vllm": [paths]} (every
      route the app serves from that dialect's routers, :data:`DIALECT_ROUTERS`), "weight_sync":
      {"methods": [the engine's update_weights_* names], "tensor_payloads": ["safetensors"]
      (+ "pickle" with --trust-weight-payloads), "checksum": "sha256"}}``; under ``--ray``
      also ``"fleet"`` (per replica: state, weight version, running requests).
  ``POST /engine/control/{name}``, ``POST /engine/update/{name}``
      the engine's own ``engine_control`` / ``engine_update`` for the names it advertises
      (``supported_controls()`` / ``supported_updates()``); the response is the engine's
      object plus ``"state"``. ``pause_generation {mode="abort"|"wait"|"keep",
      clear_cache}``, ``resume_generation``, ``sleep {level=1, mode="abort", tags}`` (alias
      ``release_memory_occupation``), ``wake_up {tags}`` (alias
      ``resume_memory_occupation``), ``update_weights_*`` and ``update_weight_version``
      go through the admin state machine; ``load_lora {lora_name, lora_path}`` /
      ``unload_lora {lora_name}`` through the LoRA adapters (so they are listed as models).
  ``GET|POST /engine/<rl route>``
      the RL routes (``liveness_probe``, ``pause_generation`` (default mode ``keep``),
      ``resume_generation``, ``flush_cache``, ``abort_request``,
      ``update_weights_from_disk|_distributed|_tensor|_nixl``,
      ``init_weights_update_group``, ``destroy_weights_update_group``,
      ``get_weight_version``, ``set_weight_version``, ``load_lora``, ``unload_lora``,
      ``weights_checker``, ``get_weights_by_name``); every weight update answers with
      ``checksum`` (:mod:`penstock.engines.weights.sync` says how it is computed); bodies
      and responses are documented in :mod:`penstock.rl.routes`.

State machine (:mod:`penstock.rl.state`): ``serving``, ``paused(mode)``,
``sleeping(tags)``, ``updating(version)``, ``draining``. ``/health`` answers 503 with the
state whenever it is not ``serving``; ``/live`` stays 200.

Bounded operations: no admin call waits without bound. Waiting for the admin lock and the
engine calls of one operation share one deadline, ``--admin-timeout-s``
(``PENSTOCK_ADMIN_TIMEOUT_S``, default 30 s); past it the call answers 409 with
``error.state``: code ``admin_busy`` if another operation kept the lock, ``admin_timeout``
if the engine overran (e.g. a ``wait``-mode pause or sleep whose in-flight requests did
not finish). The overrunning call is cancelled and a pause or sleep undone, so the state
is the one before the call; a cancelled weight update publishes no new version.

Sleeping while paused in mode ``keep`` (SGLang ``retract``/``in_place``): the frozen
requests are not running, so the sleep's mode decides, as vLLM's sleep mode does for
in-flight requests: ``abort`` (the ``/sleep`` and ``/engine/control/sleep`` default) ends
them with ``finish_reason`` ``"abort"``; ``keep`` and ``wait`` leave them frozen (``wait``
has nothing running to wait for), and they continue after ``wake_up`` then ``resume``,
as SGLang's ``/release_memory_occupation`` after a ``retract`` pause lets them. Requests
that arrived while paused or asleep are never dropped: they run after the resume.

Statuses: success 200 (repeating an operation is a no-op, 200, same state); a body that is
not a JSON object or a field of the wrong type 400 naming the field; an engine that
refuses (e.g. a missing weights path, mismatched shapes) 400 with its reason, and the
previous state and weights keep serving; an engine that lacks the control 400; an
invalid transition (e.g. a weight update while serving: "pause generation before
updating weights") or an operation past the admin timeout 409 with ``error.state`` (the
state name) and ``error.admin`` (the full state); an unknown name 404 whose message and
``error.supported`` list what exists.

Auth: every admin route needs an admin key (``--admin-api-key``, repeatable, or
``PENSTOCK_ADMIN_API_KEYS``) as ``Authorization: Bearer <key>``: none 401, any other key
(inference keys included) 403. Inference keys never open admin routes. With no admin key
configured the admin routes answer loopback clients only (others get 403).

Weight versions on inference outputs (the response extension): every chat/completions
response and every stream chunk carries ``weight_version`` (the version of the weights
that produced it: what the engine stamps in ``engine_data["weight_version"]``, else the
gateway's current version). A non-stream choice also carries ``weight_versions``:
``[{"weight_version": v, "start_token": i}, ...]``, one segment per version it saw (a
request frozen by a ``keep`` pause across an update has two).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute

from penstock.engines.contract import SUPPORTS_DETERMINISTIC
from penstock.errors import NotFoundError, clip
from penstock.rl.fields import (
    bool_field,
    int_field,
    json_object_body,
    mode_field,
    required_str,
    str_field,
    tags_field,
)
from penstock.rl.plane import AdminPlane
from penstock.rl.state import WEIGHT_UPDATES_PREFIX
from penstock.routers import (
    areal_lora,
    generate,
    lora,
    profiling,
    sglang_compat,
    trainer_compat,
    vllm_compat,
)
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key

router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])

SLEEP_CONTROLS = frozenset({"sleep", "release_memory_occupation"})
WAKE_CONTROLS = frozenset({"wake_up", "resume_memory_occupation"})
# The routers of each dialect; ``/engine/capabilities`` lists the paths of the routes
# registered on them, so a new route is listed the moment it is served.
DIALECT_ROUTERS: dict[str, tuple[APIRouter, ...]] = {
    "sglang": (sglang_compat.router, generate.router, profiling.router),
    # vLLM's own routes and those of the vLLM servers trainers launch (trl vllm-serve,
    # SkyRL's, prime-rl's, AReaL's).
    "vllm": (
        vllm_compat.router,
        lora.router,
        trainer_compat.inference_router,
        trainer_compat.admin_router,
        areal_lora.admin_router,
    ),
}


def dialect_routes() -> dict[str, list[str]]:
    """Per dialect, the path of every route its routers hold, in registration order (a
    router included in another is listed on its own)."""
    listed: dict[str, list[str]] = {}
    for dialect, routers in DIALECT_ROUTERS.items():
        paths = [r.path for router in routers for r in router.routes if isinstance(r, APIRoute)]
        listed[dialect] = list(dict.fromkeys(paths))
    return listed


def unknown(kind: str, name: str, supported: list[str]) -> NotFoundError:
    listed = ", ".join(supported) or "none"
    return NotFoundError(
        f"unknown {kind} '{clip(name)}'; supported: {listed}",
        code="unknown_route",
        extra={"supported": supported},
    )


@router.get("/engine/capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    engine = plane.state.engine
    described = plane.registry.describe()
    return {
        "object": "engine.capabilities",
        "engine": type(engine).__name__,
        "controls": sorted(engine.supported_controls()),
        "updates": sorted(engine.supported_updates()),
        "rl_routes": described["routes"],
        "system_url": described.get("system_url"),
        "state": plane.state.describe(),
        "weight_version": plane.state.weight_version,
        "lora": {
            "supported": plane.adapters.supported,
            "loaded": plane.adapters.listing(),
            "schemes": plane.adapters.manager.schemes,
        },
        "dialects": dialect_routes(),
        "weight_sync": {
            "methods": sorted(
                name for name in engine.supported_updates() if name.startswith("update_weights_")
            ),
            "tensor_payloads": ["safetensors"]
            + (["pickle"] if plane.state.trust_weight_payloads else []),
            "checksum": "sha256",
        },
        "deterministic": _deterministic(request),
        **_fleet(request),
    }


def _deterministic(request: Request) -> bool:
    """Whether the engine runs in its ``--deterministic`` mode (see the engine contract)."""
    models = request.app.state.gateway.listed_models()
    config = models[0].host.engine_config if models else None
    return bool(config and config.runtime_data and config.runtime_data.get(SUPPORTS_DETERMINISTIC))


def _fleet(request: Request) -> dict[str, Any]:
    """Under ``--ray``: each replica's state, weight version and running requests."""
    fleet = request.app.state.gateway.fleet
    return {} if fleet is None else {"fleet": fleet.describe_fleet()}


async def run_control(plane: AdminPlane, name: str, body: dict[str, Any]) -> dict[str, Any]:
    state = plane.state
    if name == "pause_generation":
        outcome = await state.pause(
            mode_field(body, "mode", "abort"), bool_field(body, "clear_cache", False)
        )
        return outcome.engine
    if name == "resume_generation":
        return (await state.resume()).engine
    if name in SLEEP_CONTROLS:
        level = int_field(body, "level", 1, low=0, high=2)
        outcome = await state.sleep(level, mode_field(body, "mode", "abort"), tags_field(body))
        return outcome.engine
    if name in WAKE_CONTROLS:
        return (await state.wake_up(tags_field(body))).engine
    return await state.run_control(name, body)


async def run_update(plane: AdminPlane, name: str, body: dict[str, Any]) -> dict[str, Any]:
    state = plane.state
    if name == "update_weight_version":
        return (await state.set_weight_version(required_str(body, "new_version"))).engine
    if name.startswith(WEIGHT_UPDATES_PREFIX):
        version = str_field(body, "weight_version")
        param = "model_path" if "model_path" in body else None
        return (await state.update_weights(name, body, version, param=param)).engine
    if name == "load_lora":
        lora_name = required_str(body, "lora_name")
        path = required_str(body, "lora_path")
        adapter, _ = await plane.adapters.load(lora_name, path, field="lora_path")
        return {"status": "ok", **adapter.describe()}
    if name == "unload_lora":
        adapter = await plane.adapters.unload(required_str(body, "lora_name"))
        return {"status": "ok", **adapter.describe()}
    return await state.run_update(name, body)


@router.post("/engine/control/{name}")
async def engine_control(name: str, request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    supported = sorted(plane.state.engine.supported_controls())
    if name not in supported:
        raise unknown("engine control", name, supported)
    result = await run_control(plane, name, await json_object_body(request))
    return {**result, "state": plane.state.name}


@router.post("/engine/update/{name}")
async def engine_update(name: str, request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    supported = sorted(plane.state.engine.supported_updates())
    if name not in supported:
        raise unknown("engine update", name, supported)
    result = await run_update(plane, name, await json_object_body(request))
    return {**result, "state": plane.state.name}


# One route per method, each with its own OpenAPI operation id.
@router.get("/engine/{name}", operation_id="rl_route_get")
@router.post("/engine/{name}", operation_id="rl_route_post")
async def rl_route(name: str, request: Request) -> dict[str, Any] | None:
    plane = admin_plane(request)
    handler = plane.registry.routes.get(name)
    if handler is None:
        raise unknown("admin route", f"/engine/{name}", sorted(plane.registry.routes))
    return await handler(await json_object_body(request))
