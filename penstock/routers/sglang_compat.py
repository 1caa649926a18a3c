"""SGLang-shaped admin routes, for trainers that already speak SGLang (slime, verl, ...).

Same process, same admin state machine and engine as ``/engine/*`` (see
:mod:`penstock.routers.admin` for auth, states and error statuses). Requests and
responses:

* ``POST /pause_generation {mode="abort"|"retract"|"in_place"}`` (also ``wait``/``keep``;
  ``retract`` and ``in_place`` both freeze in-flight requests, which continue on resume)
  -> ``{"status": "ok", "message": "Generation paused successfully.", "mode", "state"}``
* ``POST /continue_generation`` -> ``{"status": "ok", "message": "Generation continued
  successfully.", "state"}``
* ``POST /update_weights_from_disk {model_path, weight_version?, abort_all_requests=false,
  flush_cache=true}`` (needs the paused state) -> ``{"success": true, "message",
  "num_paused_requests": 0, "weight_version"}``
* ``POST /update_weight_version {new_version, abort_all_requests=false}`` -> ``{"success":
  true, "message", "new_version"}`` (in-flight requests are kept unless asked otherwise)
* ``GET /get_weight_version`` -> ``{"weight_version"}``
* ``GET|POST /flush_cache`` -> text ``Cache flushed.``
* ``POST /abort_request {rid?, abort_all=false}`` -> ``{"status": "ok", "aborted": [ids]}``
  (no ``rid``, or ``""``, with ``abort_all`` false ends nothing, as in SGLang)
* ``GET|POST /release_memory_occupation {tags?}`` (running requests finish first, within
  the admin timeout; requests frozen by a ``retract``/``in_place`` pause stay frozen and
  continue after ``resume_memory_occupation`` and ``continue_generation``) and
  ``GET|POST /resume_memory_occupation {tags?}`` -> ``{"status": "ok", "message", "tags",
  "is_sleeping", "state"}``
* ``POST /load_lora_adapter {lora_name, lora_path}``, ``POST /unload_lora_adapter
  {lora_name}`` -> ``{"success": true, "error_message": "", "loaded_adapters": {name:
  path}}``; loading a loaded name again replaces it in place
* ``POST /post_process_weights {restore_weights_before_load, post_process_quantization}``
  (slime's hooks for quantized weights) -> ``{"success": true, "message"}`` with both
  false, else a 400 naming the field
* ``POST /pull_weights {local_checkpoint_dir, source_dir, target_version}`` (slime's
  delta disk sync, :mod:`penstock.rl.deltas`; needs no pause: the served weights change
  only at the reload) -> ``{"success": true, "message", "version", "seeded_from",
  "applied_versions", "patched_tensors", "skipped_tensors"}``; weights that cannot be
  applied are a 400 ``invalid_weights`` saying why
* ``POST /start_profile``, ``POST /stop_profile``: see :mod:`penstock.routers.profiling`
* ``POST /init_weights_update_group {master_address, master_port, rank_offset,
  world_size, group_name="weight_update_group", backend}`` (the trainer joins as rank 0
  at the same time; fails within the admin timeout if it never does) and
  ``POST /destroy_weights_update_group {group_name}`` -> ``{"success": true, "message"}``
* ``POST /update_weights_from_distributed {names, dtypes, shapes (or name, dtype, shape),
  group_name, load_format?: "flattened_bucket", flush_cache=true,
  abort_all_requests=false, weight_version?}`` and ``POST /update_weights_from_tensor
  {serialized_named_tensors, load_format?, flush_cache=true, abort_all_requests=false,
  weight_version?}`` and ``POST /update_weights_from_nixl {agent_name, agent_metadata,
  names, dtypes, shapes, descriptors, mem_type="DRAM", notify?, flush_cache=true,
  abort_all_requests=false, weight_version?}`` (the engine READs the trainer's registered
  memory over NIXL; not an SGLang route) (all need the paused state, but for the tensor
  push, which SGLang applies between steps: while serving it freezes running requests
  after their step, applies, and continues them on the new weights; while only the KV
  cache is released it writes the weights; formats in
  :mod:`penstock.engines.weights.sync`) -> ``{"success": true, "message",
  "weight_version", "checksum"}``
* ``POST /weights_checker {action: snapshot|reset_tensors|compare|checksum|reset,
  baseline?}`` (:mod:`penstock.rl.weights`; a failed compare is a 400 naming the tensors);
  ``GET|POST /get_weights_by_name {name, truncate_size=100}`` -> the first
  ``truncate_size`` rows as a bare JSON list, as SGLang answers (``/engine/`` adds the
  name, dtype and shape)
* ``GET /get_model_info`` -> ``{"model_path", "tokenizer_path", "is_generation",
  "preferred_sampling_params", "weight_version", "has_image_understanding",
  "has_audio_understanding"}``
* ``GET /server_info`` and ``GET /get_server_info`` -> SGLang's server arguments
  (``tp_size``, ``dp_size``, ``pp_size``, ``ep_size``, ``enable_memory_saver``, ``dtype``,
  ``disaggregation_mode``, ...) and ``{"model_path", "served_model_name",
  "tokenizer_path", "context_length", "host", "port", "weight_version", "version",
  "admin", "internal_states"}``
* ``GET /v1/loads`` -> ``{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs",
  "num_reqs"}]}``
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from penstock.errors import InvalidRequestError, clip
from penstock.rl import deltas
from penstock.rl.deltas import local_folder
from penstock.rl.fields import (
    bool_field,
    invalid,
    json_object_body,
    required_str,
    str_field,
    tags_field,
    version_number,
)
from penstock.rl.plane import AdminPlane
from penstock.routers import profiling
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key

router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])

# SGLang's retract (requeue, recompute later) and in_place (keep KV) both leave requests
# waiting to continue after resume; to the client that is ``keep``.
SGLANG_PAUSE_MODES = {
    "abort": "abort",
    "retract": "keep",
    "in_place": "keep",
    "wait": "wait",
    "keep": "keep",
}


def _penstock_version() -> str:
    try:
        return version("penstock")
    except PackageNotFoundError:
        return "unknown"


async def _abort_all(plane: AdminPlane) -> list[str]:
    if not plane.state.supports("control", "abort_request"):
        return []
    result = await plane.state.run_control("abort_request", {"abort_all": True})
    return list(result.get("aborted", []))


@router.post("/pause_generation")
async def pause_generation(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    requested = body.get("mode", "abort")
    if requested not in SGLANG_PAUSE_MODES:
        raise invalid(
            "mode", f"must be one of {', '.join(SGLANG_PAUSE_MODES)}; got {clip(repr(requested))}"
        )
    await plane.state.pause(SGLANG_PAUSE_MODES[requested])
    return {
        "status": "ok",
        "message": "Generation paused successfully.",
        "mode": requested,
        "state": plane.state.name,
    }


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    await json_object_body(request)
    await plane.state.resume()
    return {
        "status": "ok",
        "message": "Generation continued successfully.",
        "state": plane.state.name,
    }


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    model_path = required_str(body, "model_path")
    weight_version = str_field(body, "weight_version")
    abort_all = bool_field(body, "abort_all_requests", False)
    flush = bool_field(body, "flush_cache", True)
    update_body: dict[str, Any] = {"model_path": model_path}
    if weight_version is not None:
        update_body["weight_version"] = weight_version
    if abort_all:
        await _abort_all(plane)
    outcome = await plane.state.update_weights(
        "update_weights_from_disk", update_body, weight_version, param="model_path"
    )
    if flush and plane.state.supports("control", "flush_cache"):
        await plane.state.run_control("flush_cache", {})
    return {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
        "weight_version": plane.state.weight_version,
        "checksum": outcome.engine.get("checksum"),
    }


async def _push(
    request: Request, update: str, param: str | None, *, between_steps: bool = False
) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    weight_version = str_field(body, "weight_version")
    abort_all = bool_field(body, "abort_all_requests", False)
    flush = bool_field(body, "flush_cache", True)
    update_body = {k: v for k, v in body.items() if k not in ("abort_all_requests", "flush_cache")}
    if abort_all:
        await _abort_all(plane)
    outcome = await plane.state.update_weights(
        update, update_body, weight_version, param=param, between_steps=between_steps
    )
    if flush and plane.state.supports("control", "flush_cache"):
        await plane.state.run_control("flush_cache", {})
    return {
        "success": True,
        "message": "Succeeded to update model weights.",
        "weight_version": plane.state.weight_version,
        "checksum": outcome.engine.get("checksum"),
    }


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    return await _push(request, "update_weights_from_distributed", None)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
    # SGLang applies a tensor push between scheduler steps, paused or not, and while the
    # KV cache is released (verl pushes right after resuming only the weights).
    return await _push(
        request, "update_weights_from_tensor", "serialized_named_tensors", between_steps=True
    )


@router.post("/update_weights_from_nixl")
async def update_weights_from_nixl(request: Request) -> dict[str, Any]:
    return await _push(request, "update_weights_from_nixl", "descriptors")


async def _group(
    request: Request, update: str, message: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    plane = admin_plane(request)
    if body is None:
        body = await json_object_body(request)
    result = await plane.state.run_update(update, body)
    return {"success": True, "message": result.get("message", message)}


def group_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a port sent as digits (AReaL sends ``"29500"``) as the number, as
    SGLang's request model reads it."""
    port = body.get("master_port")
    if isinstance(port, str) and port.isdigit():
        return {**body, "master_port": int(port)}
    return body


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    body = group_body(await json_object_body(request))
    return await _group(request, "init_weights_update_group", "Succeeded to init group.", body)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    return await _group(request, "destroy_weights_update_group", "Succeeded to destroy group.")


@router.post("/weights_checker")
async def weights_checker(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    return await plane.checker.run(await json_object_body(request))


@router.post("/post_process_weights")
async def post_process_weights(request: Request) -> dict[str, Any]:
    body = await json_object_body(request)
    # slime's hooks for quantized weights (int4/fp4): none are served quantized here.
    for field in ("restore_weights_before_load", "post_process_quantization"):
        if bool_field(body, field, False):
            raise InvalidRequestError(
                f"{field} is not supported by this server: it serves no quantized weights "
                "to restore or repack",
                param=field,
                code="unsupported_parameter",
            )
    return {"success": True, "message": "No weights need post-processing."}


@router.post("/pull_weights")
async def pull_weights(request: Request) -> dict[str, Any]:
    """slime's delta disk sync: patch the host-local checkpoint up to ``target_version``
    (:mod:`penstock.rl.deltas`); slime reloads it with ``/update_weights_from_disk``."""
    body = await json_object_body(request)
    base = Path(str(_model_facts(request)["model_path"]))
    local = deltas.checkpoint_folder(
        required_str(body, "local_checkpoint_dir"),
        "local_checkpoint_dir",
        apart_from=[base],
        allowed=request.app.state.gateway.settings.weights_dir,
    )
    source = local_folder(required_str(body, "source_dir"), "source_dir")
    target = version_number(body, "target_version")
    # The folder's file lock orders pulls of one folder, of this process and others.
    report = await asyncio.to_thread(deltas.pull_slime, local, base, source, target)
    return {
        "success": True,
        "message": f"Local checkpoint at version {target}.",
        **report.describe(),
    }


@router.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
@router.post("/get_weights_by_name", operation_id="get_weights_by_name_post")
async def get_weights_by_name(request: Request) -> JSONResponse:
    """SGLang's answer: the parameter's first ``truncate_size`` rows as a bare JSON list
    (``/engine/get_weights_by_name`` adds the name, dtype and shape)."""
    plane = admin_plane(request)
    body = dict(await json_object_body(request))
    body.update(request.query_params)
    if isinstance(body.get("truncate_size"), str) and body["truncate_size"].isdigit():
        body["truncate_size"] = int(body["truncate_size"])
    required_str(body, "name")
    result = await plane.state.run_control("get_weights_by_name", body, param="name")
    return JSONResponse(result.get("values"))


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    new_version = required_str(body, "new_version")
    if bool_field(body, "abort_all_requests", False):
        await _abort_all(plane)
    await plane.state.set_weight_version(new_version)
    return {
        "success": True,
        "message": f"Weight version updated to {new_version}",
        "new_version": new_version,
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": admin_plane(request).state.weight_version}


# One route per method: a GET+POST route gives both the same OpenAPI operation id.
@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(request: Request) -> PlainTextResponse:
    plane = admin_plane(request)
    await plane.state.run_control("flush_cache", {})
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    if bool_field(body, "abort_all", False):
        return {"status": "ok", "aborted": await _abort_all(plane)}
    if body.get("rid") in (None, ""):
        # SGLang aborts the requests whose id is ``rid``: none has the empty id.
        return {"status": "ok", "aborted": []}
    rid = required_str(body, "rid")
    result = await plane.state.run_control("abort_request", {"request_id": rid})
    return {"status": "ok", "aborted": list(result.get("aborted", []))}


@router.get("/release_memory_occupation", operation_id="release_memory_occupation_get")
@router.post("/release_memory_occupation", operation_id="release_memory_occupation_post")
async def release_memory_occupation(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    # SGLang refuses to release memory under running requests; waiting for them to
    # finish gives the same guarantee without failing the call.
    await plane.state.sleep(1, "wait", tags_field(body))
    return _memory_response(plane, "Memory released.")


@router.get("/resume_memory_occupation", operation_id="resume_memory_occupation_get")
@router.post("/resume_memory_occupation", operation_id="resume_memory_occupation_post")
async def resume_memory_occupation(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    await plane.state.wake_up(tags_field(body))
    return _memory_response(plane, "Memory resumed.")


def _memory_response(plane: AdminPlane, message: str) -> dict[str, Any]:
    return {
        "status": "ok",
        "message": message,
        "tags": sorted(plane.state.sleep_tags),
        "is_sleeping": plane.state.is_sleeping,
        "state": plane.state.name,
    }


def _loaded_adapters(plane: AdminPlane) -> dict[str, str]:
    return {name: adapter.info.path for name, adapter in plane.adapters.adapters.items()}


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    name = required_str(body, "lora_name")
    # Reloading a loaded name replaces it in place (prime-rl reloads one name every step
    # at this route).
    await plane.adapters.load(
        name, required_str(body, "lora_path"), field="lora_path", in_place=True
    )
    return {"success": True, "error_message": "", "loaded_adapters": _loaded_adapters(plane)}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    await plane.adapters.unload(required_str(body, "lora_name"))
    return {"success": True, "error_message": "", "loaded_adapters": _loaded_adapters(plane)}


def _model_facts(request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    host = gateway.host
    config = host.engine_config
    tokenizer_path = getattr(host.worker_config, "model_name", None)
    return {
        "model_path": config.model if config is not None else None,
        "tokenizer_path": tokenizer_path,
        "served_model_name": host.served_model_name if config is not None else None,
        "context_length": config.llm.context_length if config and config.llm else None,
    }


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    facts = _model_facts(request)
    return {
        "model_path": facts["model_path"],
        "tokenizer_path": facts["tokenizer_path"],
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": admin_plane(request).state.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


# The server arguments SGLang reports that a trainer compares with its own (slime checks
# every one it would have launched an engine with): one process, one device, no
# disaggregation. ``enable_memory_saver`` is False as on an SGLang server started without
# it, which is what slime expects of an engine it did not launch; release and resume work
# regardless.
_SERVER_ARGS: dict[str, Any] = {
    "tp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "ep_size": 1,
    "moe_dp_size": 1,
    "nnodes": 1,
    "node_rank": 0,
    "enable_memory_saver": False,
    "enable_return_routed_experts": False,
    "enable_draft_weights_cpu_backup": False,
    "enable_metrics": True,
    "skip_server_warmup": True,
    "disaggregation_mode": "null",
    "encoder_only": False,
    "dtype": "auto",
    "trust_remote_code": False,
}


# ``/server_info`` is the newer name; slime asks for it first.
@router.get("/server_info", operation_id="server_info")
@router.get("/get_server_info", operation_id="get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    state = plane.state
    settings = request.app.state.gateway.settings
    return {
        **_SERVER_ARGS,
        **_model_facts(request),
        "host": settings.host,
        "port": settings.port,
        "api_key": None,
        "weight_version": state.weight_version,
        "version": _penstock_version(),
        "admin": state.describe(),
        "internal_states": [{"weight_version": state.weight_version, "state": state.name}],
    }


@router.get("/v1/loads")
async def loads(request: Request) -> dict[str, Any]:
    """Requests running and waiting, in SGLang's per-rank shape (one rank here)."""
    gate = request.app.state.gateway.host.admission
    running = gate.active if gate is not None else 0
    waiting = gate.queued if gate is not None else 0
    return {
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_reqs": running + waiting,
            }
        ]
    }


router.include_router(profiling.router)
