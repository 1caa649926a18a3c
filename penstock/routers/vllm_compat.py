"""vLLM-shaped admin routes, for trainers that already speak vLLM's RL and dev routes.

Same process, same admin state machine and engine as ``/engine/*`` (see
:mod:`penstock.routers.admin` for auth, states and error statuses). Parameters travel in
the query string, as vLLM takes them, or in a JSON body (as SkyRL sends them); a field
in the query string wins over the same field in the body:

* ``POST /pause?mode=abort|wait|keep&clear_cache=false`` -> ``{"status": "paused", "mode"}``
* ``POST /resume`` -> ``{"status": "resumed"}``
* ``GET /is_paused`` -> ``{"is_paused": bool}``
* ``POST /sleep?level=1&mode=abort`` -> ``{"status": "sleeping", "level", "tags"}``
* ``POST /wake_up?tags=weights&tags=kv_cache`` (no tags: everything) -> ``{"status":
  "awake"}`` or ``{"status": "partially_awake", "is_sleeping": true, "tags": [still asleep]}``
* ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``
* ``POST /reset_prefix_cache`` -> ``{"status": "ok"}``; ``POST /reset_mm_cache`` -> 200, no
  body (the engine's flush: cached image features and prefixes)
* ``POST /release_kv_cache_memory`` (paused, awake) -> ``{"status": "kv_cache_released"}``:
  the KV cache released as a sleep of that tag, the weights kept
* ``POST /abort_requests {request_ids?}`` (missing or empty: all) -> ``{"status":
  "aborted", "aborted": <count>}``
* ``GET /weight_info`` -> ``{"weight_version"}``
* weight transfer (JSON bodies): ``POST /init_weight_transfer_engine {init_info:
  {master_address, master_port, rank_offset, world_size, backend?, group_name?, packed?,
  packed_buffer_size_bytes?, packed_num_buffers?}}`` -> ``{"message": "Weight transfer
  initialized"}`` (a second handshake replaces the group the first joined, as vLLM
  does); ``POST /start_weight_update`` (needs the paused state) -> ``{"message": "Weight
  update started"}``; ``POST /update_weights {update_info: {names, dtype_names, shapes,
  packed?}}`` (repeatable, one bucket each; ``packed``, from the bucket or the init, is
  vLLM's packed broadcast: uint8 buffers of ``packed_buffer_size_bytes``, default 1 GiB,
  dtypes mixed) -> ``{"message": "Weights updated", "checksum"}``, or prime-rl's
  ``{weight_dir}`` (paused state; the checkpoint in that folder, as
  ``update_weights_from_disk``) -> ``{"status": "ok", "weight_version"}``;
  ``POST /finish_weight_update {weight_version?}`` publishes the version
  -> ``{"message": "Weight update finished"}``
* SkyRL's delta sync (:mod:`penstock.rl.deltas`): ``/init_weight_transfer_engine
  {init_info: {base_model_path, local_checkpoint_dir, ...}}`` (local folders) sets it up;
  ``POST /fetch_weights`` (:mod:`penstock.routers.trainer_compat`) patches the copy in
  ``<local_checkpoint_dir>/weights``; inside an opened update, ``POST /update_weights
  {update_info: {target_version}}`` reloads that copy (a 409 unless it holds that
  version) and publishes the version number as the weight version
* ``POST /weight_checker {action, baseline?}``: as SGLang's ``/weights_checker``

LoRA (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) is in
:mod:`penstock.routers.lora`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from penstock.errors import ConflictError, InvalidRequestError
from penstock.rl.deltas import checkpoint_folder, held_version, local_folder
from penstock.rl.fields import (
    bool_field,
    int_field,
    invalid,
    json_object_body,
    mode_field,
    required_str,
    str_field,
    str_list_field,
    tags_field,
    version_number,
)
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key

router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])


async def _params(request: Request, *, lists: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON body overlaid with the query string; query values are parsed as JSON
    scalars (``level=2`` is 2, ``clear_cache=true`` is True), ``lists`` repeat."""
    params = dict(await json_object_body(request))
    query = request.query_params
    for name in query:
        if name in lists:
            params[name] = query.getlist(name)
            continue
        raw = query[name]
        lowered = raw.lower()
        if lowered in ("true", "false"):
            params[name] = lowered == "true"
        elif raw.lstrip("-").isdigit():
            params[name] = int(raw)
        else:
            params[name] = raw
    return params


@router.post("/pause")
async def pause(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request)
    checked = mode_field(params, "mode", "abort")
    await plane.state.pause(checked, bool_field(params, "clear_cache", False))
    return {"status": "paused", "mode": checked}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": admin_plane(request).state.is_paused}


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request, lists=("tags",))
    level = int_field(params, "level", 1, low=0, high=2)
    mode = mode_field(params, "mode", "abort")
    await plane.state.sleep(level, mode, tags_field(params))
    return {
        "status": "sleeping",
        "level": plane.state.sleep_level,
        "tags": sorted(plane.state.sleep_tags),
    }


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request, lists=("tags",))
    await plane.state.wake_up(tags_field(params))
    if plane.state.is_sleeping:
        return {
            "status": "partially_awake",
            "is_sleeping": True,
            "tags": sorted(plane.state.sleep_tags),
        }
    return {"status": "awake"}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": admin_plane(request).state.is_sleeping}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.run_control("flush_cache", {})
    return {"status": "ok"}


@router.post("/reset_mm_cache")
async def reset_mm_cache(request: Request) -> Response:
    # vLLM's multimodal cache only saves work, as the engine's cached image features do;
    # its flush forgets them with the cached prefixes.
    await admin_plane(request).state.run_control("flush_cache", {})
    return Response(status_code=200)


@router.post("/release_kv_cache_memory")
async def release_kv_cache_memory(request: Request) -> dict[str, Any]:
    """vLLM's KV release after a completed pause, the weights kept: ``/wake_up?tags=kv_cache``
    brings it back; requests the pause froze continue after it and ``/resume``."""
    state = admin_plane(request).state
    if state.is_sleeping:
        raise state.conflict("release_kv_cache_memory needs all memory resident: wake_up first")
    if not state.is_paused:
        raise state.conflict("release_kv_cache_memory needs a completed pause first: POST /pause")
    await state.sleep(1, "keep", ["kv_cache"])
    return {"status": "kv_cache_released"}


@router.post("/abort_requests")
async def abort_requests(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    ids = str_list_field(body, "request_ids")
    engine_body: dict[str, Any] = {"request_ids": ids} if ids else {"abort_all": True}
    result = await plane.state.run_control("abort_request", engine_body)
    return {"status": "aborted", "aborted": len(result.get("aborted", []))}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict[str, Any]:
    return {"weight_version": admin_plane(request).state.weight_version}


VLLM_GROUP_NAME = "vllm_weight_transfer"
# vLLM's packed broadcast: whether buckets are packed, and the buffers' size (the number of
# buffers only overlaps the trainer's work; the bytes on the wire are the same).
_PACKED_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
_PACKED_WIRE = "vllm_packed_wire"
_JOINED_GROUP = "vllm_joined_group"


def _object_field(body: dict[str, Any], field: str) -> dict[str, Any]:
    value = body.get(field)
    if not isinstance(value, dict):
        raise invalid(field, "must be an object")
    return value


@dataclass(frozen=True)
class DeltaTarget:
    """SkyRL's delta sync of this server: the checkpoint its deltas start from, and the
    folder whose ``weights`` copy they patch (:func:`penstock.rl.deltas.fetch_skyrl`)."""

    base: Path
    local_root: Path

    @property
    def weights(self) -> Path:
        return self.local_root / "weights"


_DELTA_TARGET = "skyrl_delta_target"


def delta_target(request: Request) -> DeltaTarget:
    target: DeltaTarget | None = getattr(request.app.state, _DELTA_TARGET, None)
    if target is None:
        raise ConflictError(
            "no delta weight sync set up: POST /init_weight_transfer_engine with an "
            "init_info naming base_model_path and local_checkpoint_dir first",
            code="invalid_state_transition",
        )
    return target


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    info = _object_field(await json_object_body(request), "init_info")
    if "local_checkpoint_dir" in info or "base_model_path" in info:
        # SkyRL's delta backend: no group to join; later fetches patch a local copy.
        base = local_folder(required_str(info, "base_model_path"), "init_info.base_model_path")
        config = request.app.state.gateway.host.engine_config
        served = [Path(config.model)] if config is not None and config.model else []
        local = checkpoint_folder(
            required_str(info, "local_checkpoint_dir"),
            "init_info.local_checkpoint_dir",
            apart_from=[base, *served],
            allowed=request.app.state.gateway.settings.weights_dir,
        )
        target = DeltaTarget(base, local)
        if not await asyncio.to_thread(target.base.is_dir):
            raise invalid("init_info.base_model_path", "must name a checkpoint folder")
        setattr(request.app.state, _DELTA_TARGET, target)
        return {"message": "Weight transfer initialized"}
    wire = {key: info[key] for key in _PACKED_FIELDS if key in info}
    group = {"group_name": VLLM_GROUP_NAME}
    group.update((k, v) for k, v in info.items() if k not in _PACKED_FIELDS)
    joined = getattr(request.app.state, _JOINED_GROUP, None)
    if joined is not None:
        # vLLM's worker replaces its communicator at every handshake (a restarted trainer).
        setattr(request.app.state, _JOINED_GROUP, None)
        with contextlib.suppress(InvalidRequestError):
            await plane.state.run_update("destroy_weights_update_group", {"group_name": joined})
    await plane.state.run_update("init_weights_update_group", group)
    setattr(request.app.state, _JOINED_GROUP, group["group_name"])
    # vLLM's worker keeps the trainer's wire parameters from the handshake for every bucket.
    setattr(request.app.state, _PACKED_WIRE, wire)
    return {"message": "Weight transfer initialized"}


def begin_weight_update(request: Request) -> None:
    """Open a bucketed weight update (paused state only); buckets follow."""
    plane = admin_plane(request)
    if not plane.state.is_paused:
        raise plane.state.conflict("pause generation (POST /pause) before a weight update")
    request.app.state.vllm_weight_update = True


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    await json_object_body(request)
    begin_weight_update(request)
    return {"message": "Weight update started"}


def _require_started(request: Request) -> None:
    if not getattr(request.app.state, "vllm_weight_update", False):
        raise ConflictError(
            "no weight update in progress: POST /start_weight_update first",
            code="invalid_state_transition",
        )


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """vLLM's bucket ``{update_info}``, or prime-rl's reload ``{weight_dir}``."""
    body = await json_object_body(request)
    if "weight_dir" in body and "update_info" not in body:
        return await reload_weight_dir(request, body)
    info = _object_field(body, "update_info")
    if "names" not in info and ("target_version" in info or "version" in info):
        return await reload_delta_checkpoint(request, info)
    return await receive_bucket(request, info)


async def reload_delta_checkpoint(request: Request, info: dict[str, Any]) -> dict[str, Any]:
    """SkyRL's delta reload: the local copy ``/fetch_weights`` brought to the target
    version, loaded as a disk update inside an opened weight update."""
    plane = admin_plane(request)
    _require_started(request)
    field = "target_version" if "target_version" in info else "version"
    version = version_number(info, field)
    target = delta_target(request)
    held = held_version(target.weights)
    if held != version:
        raise ConflictError(
            f"the local checkpoint holds version {held}, not {version}: POST /fetch_weights "
            f"{{target_version: {version}}} first",
            code="invalid_state_transition",
        )
    outcome = await plane.state.update_weights(
        "update_weights_from_disk",
        {"model_path": str(target.weights)},
        str(version),
        param=f"update_info.{field}",
    )
    return {"message": "Weights updated", "checksum": outcome.engine.get("checksum")}


async def reload_weight_dir(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """prime-rl's filesystem update: the checkpoint in ``weight_dir``, while paused. Its
    NCCL mode (``weight_dir`` null) needs ``/init_broadcaster``, which this server refuses."""
    plane = admin_plane(request)
    weight_dir = str_field(body, "weight_dir")
    if weight_dir is None:
        raise invalid(
            "weight_dir",
            "must name a checkpoint folder; a null weight_dir asks for prime-rl's NCCL "
            "broadcast, which this server does not offer (see /init_broadcaster)",
        )
    await plane.state.update_weights(
        "update_weights_from_disk", {"model_path": weight_dir}, None, param="weight_dir"
    )
    return {"status": "ok", "weight_version": plane.state.weight_version}


async def receive_bucket(request: Request, info: dict[str, Any]) -> dict[str, Any]:
    """One broadcast bucket (``names``, ``dtype_names``, ``shapes``, ``packed``) of an
    update opened by :func:`begin_weight_update`; ``packed`` and the buffer size come
    from the bucket or else from the handshake's ``init_info``."""
    plane = admin_plane(request)
    _require_started(request)
    body: dict[str, Any] = {
        "group_name": info.get("group_name", VLLM_GROUP_NAME),
        "names": info.get("names"),
        "dtypes": info.get("dtype_names", info.get("dtypes")),
        "shapes": info.get("shapes"),
    }
    wire = {**getattr(request.app.state, _PACKED_WIRE, {}), **info}
    if bool_field(wire, "packed", False):
        body["load_format"] = "packed"
        if "packed_buffer_size_bytes" in wire:
            body["packed_buffer_size_bytes"] = wire["packed_buffer_size_bytes"]
    outcome = await plane.state.update_weights("update_weights_from_distributed", body, None)
    return {"message": "Weights updated", "checksum": outcome.engine.get("checksum")}


async def end_weight_update(request: Request, version: str | None) -> None:
    """Close the update :func:`begin_weight_update` opened, publishing ``version``."""
    _require_started(request)
    if version is not None:
        await admin_plane(request).state.set_weight_version(version)
    request.app.state.vllm_weight_update = False


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    body = await json_object_body(request)
    await end_weight_update(request, str_field(body, "weight_version"))
    return {
        "message": "Weight update finished",
        "weight_version": admin_plane(request).state.weight_version,
    }


@router.post("/weight_checker")
async def weight_checker(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    return await plane.checker.run(await json_object_body(request))
