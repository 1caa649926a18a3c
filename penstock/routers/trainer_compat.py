"""Routes RL frameworks call on the inference servers they launch themselves, beyond
SGLang's and vLLM's own (``docs/rl-trainers.md`` lists every call, framework by framework).

Inference routes (the inference keys guard them like ``/v1/completions``; bodies in
:mod:`penstock.serving.tokens`):

* ``POST /inference/v1/generate``: vLLM's token-in/token-out generation (SkyRL, prime-rl)
* ``POST /generate/``: ``trl vllm-serve``'s batch generation (TRL's ``VLLMClient``)
* ``POST /skyrl/v1/generate`` (SkyRL, for a mixture-of-experts model's routed experts): a
  400 naming ``routed_experts``, which no engine here records

Health, as the inference keys allow: ``GET /health/`` (TRL; 200 ``{"status": "ok"}``
when requests would be served now, else 503) and ``GET /liveness`` (prime-rl; 200 while
the engine passes its health checks, else 503).

Admin routes (the admin key, as every admin dialect):

* ``GET /get_world_size`` (vLLM; SkyRL) and ``GET /get_world_size/`` (TRL) ->
  ``{"world_size": 1}``: one process serves the model
* ``POST /collective_rpc {method, kwargs?}`` (SkyRL's worker methods) -> ``{"results":
  [result]}``: ``skyrl_sleep_for_weight_sync {offload_kv}`` and
  ``skyrl_wake_for_weight_sync {tags}`` (sleep level 1 keeping paused requests; wake the
  tags), ``skyrl_start_weight_update``, ``update_weights_nccl {update_info}`` and
  ``skyrl_finish_weight_update`` (vLLM's bucketed broadcast update, see
  :mod:`penstock.routers.vllm_compat`); ``update_weights_ipc`` (CUDA IPC handles) is
  refused (below), another method a 400 naming it
* ``POST /reset_prefix_cache/`` (TRL) -> ``{"message"}``; ``POST /close_communicator/``
  -> ``{"message"}`` (no communicator is ever open)
* ``POST /fetch_weights {target_version, sync_dir?, uri?}`` (SkyRL's delta checkpoints):
  400 ``transport_unavailable``
* ``POST /init_communicator/`` and ``POST /update_named_param/`` (TRL) and
  ``POST /init_broadcaster`` (prime-rl): 400 ``transport_unavailable`` naming what is
  missing, as every transfer this server cannot make. These trainers broadcast over NCCL through
  vLLM's ``StatelessProcessGroup`` and ``PyNcclCommunicator`` (prime-rl: its own NCCL
  or NIXL broadcaster), which needs CUDA; Penstock's broadcast joins a torch process
  group instead (``/init_weights_update_group``, ``/init_weight_transfer_engine``).
* AReaL's vLLM server routes, each -> ``{"success": true, "message"}``:
  ``/areal_pause_generation`` (abort), ``/areal_continue_generation``,
  ``/areal_init_weights_update_group`` (as ``/init_weights_update_group``; a port in
  digits is a number), ``/areal_set_update_weight_meta {names, dtypes, shapes,
  group_name}`` then ``/areal_update_weights_xccl`` (one broadcast of those tensors),
  ``/areal_update_weights {model_path}`` (from disk); both updates pause, aborting, when
  generation is not paused already. Its LoRA broadcast and in-place reload routes are
  refused: adapters load from a folder here.
"""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from penstock.errors import ConflictError, InvalidRequestError, clip
from penstock.rl.fields import bool_field, invalid, json_object_body, required_str, tags_field
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key
from penstock.routers.sglang_compat import group_body
from penstock.routers.vllm_compat import begin_weight_update, end_weight_update, receive_bucket
from penstock.schemas.fields import refuse_unknown, refuse_unsupported
from penstock.schemas.openai import NonNegativeInt
from penstock.schemas.unicode import JSONValue, RequestModel
from penstock.serving.tokens import run_tokens, sampling_request

# The app-wide inference-key check guards these (see ``security.require_inference_key``).
inference_router = APIRouter(tags=["rl-trainers"])
admin_router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])
router = APIRouter()

WORLD_SIZE = 1


class TransportUnavailableError(InvalidRequestError):
    """A weight transfer that needs hardware or a library this server does not have: a
    request this server can never serve, so a 400 naming what is missing."""

    default_code = "transport_unavailable"


class TokensGenerateBody(RequestModel):
    """vLLM's ``GenerateRequest`` (``/inference/v1/generate``)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    token_ids: Annotated[list[NonNegativeInt], Field(min_length=1)]
    sampling_params: dict[str, JSONValue] = Field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, JSONValue] | None = None
    # Keeps requests from reusing cached KV: a cached prefix only saves work here (every
    # weight update clears it), so the output is the same with or without it.
    cache_salt: str | None = None


# vLLM's ``GenerateRequest`` fields this server cannot honour, with the value that asks
# for nothing.
_TOKENS_UNSUPPORTED: dict[str, Any] = {
    "features": None,
    "priority": 0,
    "kv_transfer_params": None,
    "request_id": None,
}


def _default_model(request: Request) -> str:
    listed = request.app.state.gateway.listed_models()
    if not listed:
        raise InvalidRequestError("no model is being served", param="model")
    return str(listed[0].name)


@inference_router.post("/inference/v1/generate", response_model=None)
async def tokens_generate(body: TokensGenerateBody, request: Request) -> Response:
    gateway = request.app.state.gateway
    refuse_unsupported(body, _TOKENS_UNSUPPORTED)
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "is only allowed when 'stream' is true")
    completion = sampling_request(
        body.sampling_params,
        "sampling_params",
        gateway.settings.allow_unknown_fields,
        model=body.model or _default_model(request),
        prompt=body.token_ids,
        stream=body.stream,
        stream_options=body.stream_options,
        cache_salt=body.cache_salt,
    )
    return await run_tokens(gateway, completion, request, "vllm")


class TrlGenerateBody(RequestModel):
    """The body ``trl vllm-serve`` takes at ``/generate/``."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    prompts: Annotated[list[str] | list[list[NonNegativeInt]], Field(min_length=1)]
    images: list[JSONValue] | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = 0
    structured_outputs_regex: str | None = None
    generation_kwargs: dict[str, JSONValue] = Field(default_factory=dict)


@inference_router.post("/skyrl/v1/generate", response_model=None)
async def skyrl_generate(body: TokensGenerateBody) -> NoReturn:
    # SkyRL calls this route instead of /inference/v1/generate only to read each choice's
    # ``routed_experts`` (the experts a mixture-of-experts model routed every token to).
    raise InvalidRequestError(
        "routed_experts are not supported by this server: it records no expert routing; "
        "turn off SkyRL's enable_return_routed_experts to generate at /inference/v1/generate",
        param="routed_experts",
        code="unsupported_parameter",
    )


@inference_router.post("/generate/", response_model=None)
async def trl_generate(body: TrlGenerateBody, request: Request) -> Response:
    gateway = request.app.state.gateway
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    if body.images and any(item is not None for item in body.images):
        raise InvalidRequestError("images are not supported on /generate/", param="images")
    if body.structured_outputs_regex is not None:
        raise InvalidRequestError(
            "structured_outputs_regex is not supported by this server",
            param="structured_outputs_regex",
            code="unsupported_parameter",
        )
    fields = body.model_dump(
        include={"n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p"}
    )
    fields.update(max_tokens=body.max_tokens, logprobs=body.logprobs)
    # As ``trl vllm-serve`` merges them: ``generation_kwargs`` win.
    merged = {**fields, **body.generation_kwargs}
    completion = sampling_request(
        merged,
        "generation_kwargs",
        gateway.settings.allow_unknown_fields,
        model=_default_model(request),
        prompt=body.prompts,
    )
    return await run_tokens(gateway, completion, request, "trl")


@inference_router.get("/health/")
async def trl_health(request: Request) -> JSONResponse:
    readiness = request.app.state.gateway.readiness()
    if readiness.ready:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": readiness.status, "reason": readiness.reason}, 503)


@inference_router.get("/liveness")
async def liveness(request: Request) -> JSONResponse:
    health = request.app.state.gateway.host.health
    if health.healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine_unresponsive"}, 503)


@admin_router.get("/get_world_size", operation_id="get_world_size")
@admin_router.get("/get_world_size/", operation_id="get_world_size_trl")
async def get_world_size() -> dict[str, int]:
    return {"world_size": WORLD_SIZE}


def _nccl_unavailable(route: str, framework: str) -> TransportUnavailableError:
    return TransportUnavailableError(
        f"{route} needs {framework}'s NCCL communicator (CUDA), which this server does not "
        "offer; broadcast weights through a torch process group instead "
        "(/init_weights_update_group or /init_weight_transfer_engine, gloo on the CPU)"
    )


@admin_router.post("/init_communicator/", response_model=None)
async def init_communicator(request: Request) -> NoReturn:
    await json_object_body(request)
    raise _nccl_unavailable("/init_communicator/", "vLLM")


@admin_router.post("/update_named_param/", response_model=None)
async def update_named_param(request: Request) -> NoReturn:
    await json_object_body(request)
    raise _nccl_unavailable("/update_named_param/", "vLLM")


@admin_router.post("/init_broadcaster", response_model=None)
async def init_broadcaster(request: Request) -> NoReturn:
    await json_object_body(request)
    raise _nccl_unavailable("/init_broadcaster", "prime-rl")


@admin_router.post("/fetch_weights", response_model=None)
async def fetch_weights(request: Request) -> NoReturn:
    body = await json_object_body(request)
    target = body.get("target_version")
    if not isinstance(target, int) or isinstance(target, bool):
        raise invalid("target_version", "must be an integer")
    raise TransportUnavailableError(
        "/fetch_weights pulls SkyRL's delta checkpoints (XOR patches of the previous "
        "weights), which this server does not apply; sync full weights with "
        "/update_weights from a folder or over a broadcast group"
    )


@admin_router.post("/close_communicator/")
async def close_communicator(request: Request) -> dict[str, str]:
    await json_object_body(request)
    return {"message": "Request received, closing communicator"}


@admin_router.post("/reset_prefix_cache/")
async def trl_reset_prefix_cache(request: Request) -> dict[str, str]:
    await admin_plane(request).state.run_control("flush_cache", {})
    return {"message": "Request received, resetting prefix cache status: True"}


def _kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid("kwargs", "must be an object")
    return kwargs


async def _skyrl_sleep(request: Request, kwargs: dict[str, Any]) -> Any:
    # Whether the KV cache is kept on the host or dropped, no frozen request loses it
    # here: a paused request keeps its state across sleep.
    bool_field(kwargs, "offload_kv", True)
    await admin_plane(request).state.sleep(1, "keep", None)
    return None


async def _skyrl_wake(request: Request, kwargs: dict[str, Any]) -> Any:
    await admin_plane(request).state.wake_up(tags_field(kwargs))
    return None


async def _skyrl_start(request: Request, kwargs: dict[str, Any]) -> Any:
    bool_field(kwargs, "is_checkpoint_format", True)
    begin_weight_update(request)
    return None


async def _skyrl_bucket(request: Request, kwargs: dict[str, Any]) -> Any:
    info = kwargs.get("update_info")
    if not isinstance(info, dict):
        raise invalid("kwargs.update_info", "must be an object")
    return await receive_bucket(request, info)


async def _skyrl_finish(request: Request, kwargs: dict[str, Any]) -> Any:
    await end_weight_update(request, None)
    return None


async def _cuda_ipc(request: Request, kwargs: dict[str, Any]) -> Any:
    raise TransportUnavailableError(
        "update_weights_ipc sends CUDA IPC handles, which need CUDA on this server; "
        "use update_weights_nccl with a gloo group on the CPU"
    )


_RPC_METHODS = {
    "skyrl_sleep_for_weight_sync": _skyrl_sleep,
    "skyrl_wake_for_weight_sync": _skyrl_wake,
    "skyrl_start_weight_update": _skyrl_start,
    "update_weights_nccl": _skyrl_bucket,
    "skyrl_finish_weight_update": _skyrl_finish,
    "update_weights_ipc": _cuda_ipc,
}


@admin_router.post("/collective_rpc", response_model=None)
async def collective_rpc(request: Request) -> dict[str, Any]:
    body = await json_object_body(request)
    method = required_str(body, "method")
    run = _RPC_METHODS.get(method)
    if run is None:
        raise invalid(
            "method", f"must be one of {', '.join(_RPC_METHODS)}; got {clip(repr(method))}"
        )
    return {"results": [await run(request, _kwargs(body))]}


# AReaL's vLLM server routes (``areal/engine/vllm_ext/areal_vllm_server.py``); each
# answers ``{"success", "message"}``. AReaL declares a broadcast's tensors first
# (``/areal_set_update_weight_meta``), then asks for them (``/areal_update_weights_xccl``).
_AREAL_META = "areal_weight_meta"


def _areal(message: str) -> dict[str, Any]:
    return {"success": True, "message": message}


async def _paused_for_update(request: Request) -> None:
    # AReaL's server pauses (aborting what runs) inside each update call.
    state = admin_plane(request).state
    if not state.is_paused:
        await state.pause("abort")


@admin_router.post("/areal_pause_generation")
async def areal_pause_generation(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.pause("abort")
    return _areal("Generation paused and all requests aborted")


@admin_router.post("/areal_continue_generation")
async def areal_continue_generation(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.resume()
    return _areal("Generation continued")


@admin_router.post("/areal_init_weights_update_group")
async def areal_init_weights_update_group(request: Request) -> dict[str, Any]:
    body = group_body(await json_object_body(request))
    await admin_plane(request).state.run_update("init_weights_update_group", body)
    return _areal("Weight update group initialized")


@admin_router.post("/areal_set_update_weight_meta")
async def areal_set_update_weight_meta(request: Request) -> dict[str, Any]:
    body = await json_object_body(request)
    for field in ("names", "dtypes", "shapes"):
        if not isinstance(body.get(field), list):
            raise invalid(field, "must be a list")
    setattr(request.app.state, _AREAL_META, body)
    return _areal("Weight update meta set")


@admin_router.post("/areal_update_weights_xccl")
async def areal_update_weights_xccl(request: Request) -> dict[str, Any]:
    await json_object_body(request)
    meta = getattr(request.app.state, _AREAL_META, None)
    if meta is None:
        raise ConflictError(
            "no tensors declared: POST /areal_set_update_weight_meta first",
            code="invalid_state_transition",
        )
    await _paused_for_update(request)
    await admin_plane(request).state.update_weights("update_weights_from_distributed", meta, None)
    return _areal("Weights updated")


@admin_router.post("/areal_update_weights")
async def areal_update_weights(request: Request) -> dict[str, Any]:
    model_path = required_str(await json_object_body(request), "model_path")
    await _paused_for_update(request)
    await admin_plane(request).state.update_weights(
        "update_weights_from_disk", {"model_path": model_path}, None, param="model_path"
    )
    return _areal("Weights updated")


@admin_router.post(
    "/areal_set_update_weight_meta_lora", response_model=None, operation_id="areal_meta_lora"
)
@admin_router.post(
    "/areal_update_weights_lora_xccl", response_model=None, operation_id="areal_lora_xccl"
)
@admin_router.post("/areal_update_weights_lora", response_model=None, operation_id="areal_lora")
async def areal_lora_update(request: Request) -> NoReturn:
    await json_object_body(request)
    raise TransportUnavailableError(
        "LoRA adapters load from a folder on this server (POST /v1/load_lora_adapter); "
        "they are not broadcast or reloaded in place"
    )


router.include_router(inference_router)
router.include_router(admin_router)
