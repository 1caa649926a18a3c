"""The engine's view of a request: its ``GenerateRequest`` dict and its ``Context``.

Everything here runs after the checks (:mod:`penstock.serving.limits`) and the prompt
(:mod:`penstock.serving.prompts`): it only builds.
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.requests import Request

from penstock.engines.context import API_KEY_METADATA, Context
from penstock.engines.contract import GenerateRequest
from penstock.errors import InvalidRequestError
from penstock.gateway import ServedModel
from penstock.metadata_upload import MetadataUploader, under_root
from penstock.schemas.openai import SamplingFields
from penstock.settings import Settings

# The header naming a client's session (its key in the engine context's metadata too).
SESSION_HEADER = "x-session-id"

# The headers an engine context reads, each with its place in ``_context_headers``'s list.
_CONTEXT_HEADERS = {SESSION_HEADER.encode(): 0, b"traceparent": 1, b"tracestate": 2}


class PassthroughRequest(GenerateRequest, total=False):
    """The contract's request plus what the gateway passes on outside its groups."""

    # Vendor extensions, as the client sent them.
    nvext: dict[str, Any]
    # vLLM's scheduling priority, only for engines that advertise SUPPORTS_PRIORITY.
    priority: int
    # vLLM's ``cache_salt``: requests share cached KV only with requests of the same salt.
    cache_salt: str


def engine_context(
    request: Request, prompt_index: int | None = None, *, user: str | None = None
) -> Context:
    """The engine's view of an HTTP request: its id (one per prompt of a batch) and trace.

    ``prompt_index`` tells the prompts of a batch apart; ``x-request-id`` stays the
    client's id so every part of the batch can be traced back to it. The session key
    (the ``X-Session-Id`` header, else the body's ``user``) travels as ``x-session-id``:
    a fleet keeps a session on one replica by it. On a server that checks API keys, a
    digest of the caller's travels as ``API_KEY_METADATA``: an engine shares out its
    constraint compiles by it.
    """
    request_id = request.state.request_id
    metadata = {"x-request-id": request_id}
    settings: Settings = request.app.state.gateway.settings
    digest = key_digest(request) if settings.api_keys else None
    if digest is not None:
        metadata[API_KEY_METADATA] = digest
    session, traceparent, tracestate = _context_headers(request)
    session = session or user
    if session:
        metadata[SESSION_HEADER] = session
    return Context(
        request_id if prompt_index is None else f"{request_id}-{prompt_index}",
        metadata,
        traceparent=traceparent,
        tracestate=tracestate,
    )


def _context_headers(request: Request) -> list[str | None]:
    """The session, ``traceparent`` and ``tracestate`` headers (each the first of its
    name, as :func:`~penstock.serving.deadline.header` reads one), in one pass over the
    raw pairs rather than one a name: every request reads them."""
    found: list[str | None] = [None, None, None]
    for key, value in request.scope["headers"]:
        slot = _CONTEXT_HEADERS.get(key)
        if slot is not None and found[slot] is None:
            found[slot] = value.decode("latin-1")
    return found


def metadata_uploader(body: SamplingFields, settings: Settings) -> MetadataUploader | None:
    """The upload ``nvext.metadata_upload`` asks for, under the operator's root.

    The request's ``url`` is only a key relative to ``--metadata-upload-url``: a client
    never picks the scheme, the host or the folder the server writes to.
    """
    try:
        asked = MetadataUploader.from_backend_request({"nvext": body.nvext})
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="nvext.metadata_upload") from exc
    if asked is None:
        return None
    if settings.metadata_upload_url is None:
        raise InvalidRequestError(
            "metadata uploads are not enabled on this server",
            param="nvext.metadata_upload",
            code="metadata_upload_disabled",
        )
    try:
        return under_root(settings.metadata_upload_url, asked.url)
    except ValueError as exc:
        raise InvalidRequestError(
            str(exc), param="nvext.metadata_upload.url", code="invalid_upload_key"
        ) from exc


# The sampling fields passed on to the engine when the client set them.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _sampling_options(body: SamplingFields) -> dict[str, Any]:
    options: dict[str, Any] = {"n": body.n}
    # Read from the model's field values: a dict lookup each, not an attribute lookup.
    values = body.__dict__
    for name in _SAMPLING_FIELDS:
        value = values[name]
        if value is not None:
            options[name] = value
    return options


def _stop_conditions(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if max_tokens is not None:
        conditions["max_tokens"] = max_tokens
    if body.min_tokens:
        conditions["min_tokens"] = body.min_tokens
    if body.stop_token_ids:
        conditions["stop_token_ids"] = list(body.stop_token_ids)
    if body.ignore_eos:
        conditions["ignore_eos"] = True
    if body.include_stop_str_in_output:
        conditions["include_stop_str_in_output"] = True
    return conditions


def _output_options(body: SamplingFields, logprobs: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if logprobs is not None:
        options["logprobs"] = logprobs
    # A declared field of completions and chat, not of every body reaching here. Read
    # from the fields: a missing attribute would cost a request pydantic's lookup of
    # private attributes and extras, and an exception.
    prompt_logprobs = body.__dict__.get("prompt_logprobs")
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    if not body.skip_special_tokens:
        options["skip_special_tokens"] = False
    return options


def generate_request(
    body: SamplingFields,
    model: ServedModel,
    token_ids: list[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    multi_modal_data: dict[str, Any] | None = None,
    guided_decoding: dict[str, Any] | None = None,
    uploader: MetadataUploader | None = None,
    key_scope: str | None = None,
) -> GenerateRequest:
    """``key_scope``: the caller's :func:`key_cache_scope`, put before its ``cache_salt``."""
    request = PassthroughRequest(
        token_ids=token_ids,
        # The canonical name (aliases resolved): a LoRA engine picks the adapter by it.
        model=model.name,
        sampling_options=_sampling_options(body),
        stop_conditions=_stop_conditions(body, max_tokens),
        output_options=_output_options(body, logprobs),
    )
    if body.nvext:
        request["nvext"] = _engine_nvext(body.nvext, uploader)
    if multi_modal_data is not None:
        request["multi_modal_data"] = multi_modal_data
    if guided_decoding is not None:
        request["sampling_options"]["guided_decoding"] = guided_decoding
    if body.priority:
        request["priority"] = body.priority
    salt = body.cache_salt
    if key_scope is not None:
        salt = key_scope if salt is None else f"{key_scope}/{salt}"
    if salt is not None:
        request["cache_salt"] = salt
    return request


def key_cache_scope(request: Request) -> str | None:
    """Where cached prefixes are kept apart by API key (``--cache-salt-by-key``, on by
    default with two or more inference keys): the caller's key as a salt, a digest of it
    (the key itself never reaches the engine). None otherwise, or without a key."""
    settings: Settings = request.app.state.gateway.settings
    by_key = settings.cache_salt_by_key
    if by_key is None:
        by_key = len(settings.api_keys) > 1
    digest = key_digest(request) if by_key else None
    return None if digest is None else f"key:{digest}"


def key_digest(request: Request) -> str | None:
    """A digest of the request's bearer token, None without one."""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).hexdigest()[:32]


def _engine_nvext(nvext: dict[str, Any], uploader: MetadataUploader | None) -> dict[str, Any]:
    """``nvext`` as the engine sees it: an upload names the resolved place under the root,
    so an engine that uploads itself (Dynamo's contract) writes where the gateway would."""
    if uploader is None:
        return nvext
    return {**nvext, "metadata_upload": {"url": uploader.url}}
