"""Routes RL frameworks call on the inference servers they launch themselves, beyond
SGLang's and vLLM's own (``docs/rl-trainers.md`` lists every call, framework by framework).

Inference routes (the inference keys guard them like ``/v1/completions``; bodies in
:mod:`penstock.serving.tokens`):

* ``POST /inference/v1/generate``: vLLM's token-in/token-out generation (SkyRL, prime-rl)
* ``POST /generate/``: ``trl vllm-serve``'s batch generation (TRL's ``VLLMClient``);
  ``structured_outputs_regex`` constrains every completion (engines that constrain)
* ``POST /chat/``: the same for conversations (``messages``: one list of messages per
  prompt, ``chat_template_kwargs``, ``tools``), each rendered by the chat template with
  the generation prompt
* ``POST /get_sequence_logprobs/``: TRL's teacher logprobs of given sequences
  (:mod:`penstock.serving.sequence_logprobs`; engines reporting prompt logprobs)
* ``POST /skyrl/v1/generate`` (SkyRL, for a mixture-of-experts model's routed experts):
  ``/inference/v1/generate`` with each choice's ``routed_experts``, from engines that
  record them (else a 400 naming ``routed_experts``)

Health, as the inference keys allow: ``GET /health/`` (TRL; 200 ``{"status": "ok"}``
when requests would be served now, else 503) and ``GET /liveness`` (prime-rl; 200 while
the engine passes its health checks, else 503).

Admin routes (the admin key, as every admin dialect):

* ``GET /get_world_size`` (vLLM; SkyRL) and ``GET /get_world_size/`` (TRL) ->
  ``{"world_size": 1}``: one process serves the model
* ``POST /collective_rpc {method, kwargs?}`` (vLLM's and SkyRL's worker methods) ->
  ``{"results": [result]}``: vLLM's ``check_health`` (503 when the engine fails its
  checks) and ``reload_weights {weights_path}`` (the checkpoint there, applied between
  engine steps with no pause, as ``update_weights_from_tensor``),
  ``skyrl_sleep_for_weight_sync {offload_kv}`` and ``skyrl_wake_for_weight_sync {tags}``
  (sleep level 1 keeping paused requests; wake the tags), ``skyrl_start_weight_update``,
  ``update_weights_nccl {update_info}`` and ``skyrl_finish_weight_update`` (vLLM's
  bucketed broadcast update, see :mod:`penstock.routers.vllm_compat`);
  ``update_weights_ipc`` (CUDA IPC handles) is refused (below), another method a 400
  naming it
* ``POST /reset_prefix_cache/`` (TRL) -> ``{"message"}``; ``POST /close_communicator/``
  -> ``{"message"}`` (no communicator is ever open)
* ``POST /fetch_weights {target_version, sync_dir?, uri?}`` (SkyRL's delta checkpoints,
  local folders; :mod:`penstock.rl.deltas`) -> ``{"status": "ok", "result": [{"status",
  "target_version", "version", "seeded_from", "applied_versions", "patched_tensors",
  "skipped_tensors"}]}``; the reload follows at ``/update_weights`` (see
  :mod:`penstock.routers.vllm_compat`)
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
  generation is not paused already. ``/areal_update_weights_lora {lora_model_path,
  lora_name, lora_int_id, base_model_name}`` reloads the adapter from its folder in place;
  the LoRA broadcast is :mod:`penstock.routers.areal_lora`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, NoReturn

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from penstock.errors import ConflictError, InvalidRequestError, ServiceUnavailableError, clip
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
from penstock.routers import areal_lora
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key
from penstock.routers.sglang_compat import group_body
from penstock.routers.vllm_compat import (
    begin_weight_update,
    delta_target,
    end_weight_update,
    receive_bucket,
)
from penstock.schemas.fields import refuse_unknown, refuse_unsupported
from penstock.schemas.openai import ChatMessage, NonNegativeInt
from penstock.schemas.unicode import JSONValue, RequestModel
from penstock.serving.guided import check_can_constrain
from penstock.serving.prompts import off_loop, render_and_tokenize
from penstock.serving.sequence_logprobs import SequenceLogprobsBody, sequence_logprobs
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
    return await _tokens(body, request, "vllm")


@inference_router.post("/skyrl/v1/generate", response_model=None)
async def skyrl_generate(body: TokensGenerateBody, request: Request) -> Response:
    """SkyRL calls this route instead of /inference/v1/generate only to read each choice's
    ``routed_experts``."""
    return await _tokens(body, request, "skyrl")


async def _tokens(body: TokensGenerateBody, request: Request, shape: str) -> Response:
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
    return await run_tokens(gateway, completion, request, shape)


class TrlSamplingBody(RequestModel):
    """The sampling fields ``trl vllm-serve`` takes beside its prompts."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

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

    def sampling_fields(self) -> dict[str, Any]:
        """The fields as ``trl vllm-serve`` builds its ``SamplingParams``: the top-level
        ones, ``generation_kwargs`` over them, the regex over both."""
        fields = self.model_dump(
            include={"n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p"}
        )
        fields.update(max_tokens=self.max_tokens, logprobs=self.logprobs)
        merged = {**fields, **self.generation_kwargs}
        if self.structured_outputs_regex is not None:
            merged["structured_outputs"] = {"regex": self.structured_outputs_regex}
        return merged


class TrlGenerateBody(TrlSamplingBody):
    """The body ``trl vllm-serve`` takes at ``/generate/``."""

    prompts: Annotated[list[str] | list[list[NonNegativeInt]], Field(min_length=1)]
    images: list[JSONValue] | None = None


Conversation = Annotated[list[ChatMessage], Field(min_length=1)]


class TrlChatBody(TrlSamplingBody):
    """The body ``trl vllm-serve`` takes at ``/chat/``: one conversation per prompt."""

    messages: Annotated[
        list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1)
    ]
    chat_template_kwargs: dict[str, JSONValue] = Field(default_factory=dict)
    tools: list[dict[str, JSONValue]] | None = None


@inference_router.post("/generate/", response_model=None)
async def trl_generate(body: TrlGenerateBody, request: Request) -> Response:
    gateway = request.app.state.gateway
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    if body.images and any(item is not None for item in body.images):
        raise InvalidRequestError("images are not supported on /generate/", param="images")
    return await _trl_run(request, body, body.prompts)


@inference_router.post("/chat/", response_model=None)
async def trl_chat(body: TrlChatBody, request: Request) -> Response:
    """Each conversation through the chat template (with the generation prompt, as
    vLLM's ``LLM.chat``), then generated as ``/generate/`` generates token ids."""
    gateway = request.app.state.gateway
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    model = gateway.resolve(_default_model(request))
    preprocessor = model.preprocessor
    if preprocessor is None:
        raise InvalidRequestError(
            f"The model '{model.name}' has no tokenizer configured", param="messages"
        )
    prompts = []
    for i, conversation in enumerate(body.messages):
        for j, message in enumerate(conversation):
            if isinstance(message.content, list) and any(
                part.type != "text" for part in message.content
            ):
                raise InvalidRequestError(
                    "/chat/ generates from text: media parts are not supported here",
                    param=f"messages[{i}][{j}].content",
                    code="unsupported_parameter",
                )
        messages = [message.model_dump(exclude_none=True) for message in conversation]
        size = len(orjson.dumps(messages))
        prompts.append(
            await off_loop(
                gateway,
                None,
                size,
                render_and_tokenize,
                gateway.settings,
                model,
                preprocessor,
                messages,
                add_generation_prompt=True,
                tools=body.tools,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        )
    return await _trl_run(request, body, prompts)


async def _trl_run(
    request: Request, body: TrlSamplingBody, prompts: list[str] | list[list[int]]
) -> Response:
    gateway = request.app.state.gateway
    if body.structured_outputs_regex is not None:
        name = _default_model(request)
        check_can_constrain(gateway.resolve(name), "structured_outputs_regex", name)
    completion = sampling_request(
        body.sampling_fields(),
        "generation_kwargs",
        gateway.settings.allow_unknown_fields,
        model=_default_model(request),
        prompt=prompts,
    )
    return await run_tokens(gateway, completion, request, "trl")


@inference_router.post("/get_sequence_logprobs/", response_model=None)
async def trl_sequence_logprobs(body: SequenceLogprobsBody, request: Request) -> Response:
    gateway = request.app.state.gateway
    return await sequence_logprobs(gateway, body, _default_model(request), request)


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


@admin_router.post("/fetch_weights")
async def fetch_weights(request: Request) -> dict[str, Any]:
    """SkyRL's delta pull, before it pauses: the served weights change only at the
    ``/update_weights`` reload that follows."""
    body = await json_object_body(request)
    target_version = version_number(body, "target_version")
    sync_dir = str_field(body, "sync_dir")
    uri = str_field(body, "uri")
    target = delta_target(request)
    report = await asyncio.to_thread(
        deltas.fetch_skyrl,
        target.local_root,
        target.base,
        None if sync_dir is None else local_folder(sync_dir, "sync_dir"),
        None if uri is None else local_folder(uri, "uri"),
        target_version,
    )
    return {
        "status": "ok",
        "result": [{"status": "ok", "target_version": target_version, **report.describe()}],
    }


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


async def _check_health(request: Request, kwargs: dict[str, Any]) -> Any:
    if not request.app.state.gateway.host.health.healthy:
        raise ServiceUnavailableError("the engine fails its health checks")
    return None


async def _reload_weights(request: Request, kwargs: dict[str, Any]) -> Any:
    """vLLM's in-place reload from a checkpoint folder, run between engine steps as its
    worker RPCs are: no pause needed."""
    path = required_str(kwargs, "weights_path")
    if not bool_field(kwargs, "is_checkpoint_format", True):
        raise invalid("kwargs.is_checkpoint_format", "must be true: checkpoints load as saved")
    await admin_plane(request).state.update_weights(
        "update_weights_from_disk",
        {"model_path": path},
        None,
        param="kwargs.weights_path",
        between_steps=True,
    )
    return None


_RPC_METHODS = {
    "check_health": _check_health,
    "reload_weights": _reload_weights,
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
    if body.get("args") not in (None, []):
        raise invalid("args", "must be empty: pass the method's arguments as kwargs")
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


@admin_router.post("/areal_update_weights_lora")
async def areal_update_weights_lora(request: Request) -> dict[str, Any]:
    """AReaL's adapter reload from a folder, in place under its name: requests already
    running finish with the adapter they started with, so nothing is paused or aborted."""
    body = await json_object_body(request)
    path = required_str(body, "lora_model_path")
    name = required_str(body, "lora_name")
    base = str_field(body, "base_model_name")
    served = _default_model(request)
    if base is not None and base != served:
        raise invalid("base_model_name", f"must be the served model {clip(repr(served))}")
    await admin_plane(request).adapters.load(name, path, field="lora_model_path", in_place=True)
    return _areal(f"LoRA adapter {name!r} updated")


router.include_router(inference_router)
router.include_router(admin_router)
router.include_router(areal_lora.admin_router)
