"""``POST /v1/chat/completions``.

Response extensions (all optional for OpenAI clients): ``weight_version`` on every
response and stream chunk (the engine weights that produced it); per choice
``weight_versions`` (``[{"weight_version", "start_token"}]``) in non-stream responses;
``prompt_token_ids`` and per-choice ``token_ids`` when ``return_token_ids`` is set.
A choice whose request was cancelled (client, admin pause in abort mode) finishes with
``finish_reason: "abort"``, as vLLM and SGLang report it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from penstock.engines.context import Context
from penstock.errors import InvalidRequestError
from penstock.gateway import ServedModel
from penstock.metadata_upload import MetadataUploader
from penstock.schemas.openai import ChatCompletionRequest
from penstock.serving.framing import (
    ChunkEncoder,
    ClientDisconnected,
    json_response,
    unless_disconnected,
    with_error_frame,
)
from penstock.serving.generation import Generation, LogprobEntry
from penstock.serving.requests import (
    chat_prompt,
    check_budget,
    check_common_limits,
    generate_request,
    metadata_uploader,
)
from penstock.serving.sse import DONE_FRAME, EventStreamResponse

router = APIRouter(tags=["openai"])


def chat_logprobs(model: ServedModel, entries: list[LogprobEntry]) -> dict[str, Any]:
    pre = model.preprocessor

    def token(token_id: int) -> tuple[str, list[int]]:
        if pre is None:
            return f"token_id:{token_id}", []
        return pre.token_text(token_id), pre.token_bytes(token_id)

    content = []
    for token_id, logprob, alternatives in entries:
        text, raw = token(token_id)
        top = []
        for alt_id, alt_logprob in alternatives:
            alt_text, alt_raw = token(alt_id)
            top.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _parse_tool_calls(body: ChatCompletionRequest, model: ServedModel) -> bool:
    """Tools reach the chat template; calls are parsed only with a configured parser."""
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise InvalidRequestError(
            "only tool_choice 'auto' and 'none' are supported: this server can't force a call",
            param="tool_choice",
        )
    return bool(body.tools) and choice != "none" and model.tool_call_parser is not None


def _context(request: Request) -> Context:
    request_id = request.state.request_id
    return Context(
        request_id,
        {"x-request-id": request_id},
        traceparent=request.headers.get("traceparent"),
        tracestate=request.headers.get("tracestate"),
    )


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    gateway = request.app.state.gateway
    model = gateway.resolve(body.model)
    if "chat" not in model.endpoint_types:
        raise InvalidRequestError(
            f"The model '{body.model}' does not serve chat completions", param="model"
        )
    check_common_limits(body, gateway.settings, model)
    uploader = metadata_uploader(body)
    token_ids, extra = chat_prompt(body, model)
    max_tokens = body.max_new_tokens
    check_budget(len(token_ids), max_tokens, model, "messages")
    want_logprobs = body.logprobs
    engine_request = generate_request(
        body,
        model,
        token_ids,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if want_logprobs else None,
        extra=extra,
    )
    generation = Generation(
        gateway,
        model,
        engine_request,
        _context(request),
        stops=body.stop_list,
        keep_text=not body.stream,
        want_logprobs=want_logprobs,
        endpoint="chat_completions",
        streaming=body.stream,
        parse_tool_calls=_parse_tool_calls(body, model),
    )
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        return await _stream(body, model, generation, uploader, response_id, created)
    try:
        result = await unless_disconnected(
            request, _complete(body, model, generation, uploader, response_id, created)
        )
    except ClientDisconnected:
        return Response(status_code=499)
    return json_response(result)


async def _complete(
    body: ChatCompletionRequest,
    model: ServedModel,
    generation: Generation,
    uploader: MetadataUploader | None,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    async for _ in generation.deltas():
        pass
    await generation.upload_metadata(uploader)
    choices = []
    for choice in generation.choices:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        if choice.tool_calls:
            message["content"] = choice.text or None
            message["tool_calls"] = [call.as_openai() for call in choice.tool_calls]
        item: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(model, choice.logprobs)
            if choice.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
            "weight_versions": choice.weight_version_segments(),
        }
        if body.return_token_ids:
            item["token_ids"] = choice.token_ids
        choices.append(item)
    response: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": generation.usage(),
        "weight_version": generation.weight_version,
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = generation.request["token_ids"]
    return response


async def _stream(
    body: ChatCompletionRequest,
    model: ServedModel,
    generation: Generation,
    uploader: MetadataUploader | None,
    response_id: str,
    created: int,
) -> Response:
    encoder = ChunkEncoder(response_id, "chat.completion.chunk", created, body.model)
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(options and options.continuous_usage_stats)
    return_ids = body.return_token_ids
    deltas = generation.deltas()
    # Wait for the engine's first output before committing to 200, so errors the engine
    # raises at once (bad parameters) still get their real status.
    first = await anext(deltas, None)

    async def frames() -> Any:
        for choice in generation.choices:
            role: dict[str, Any] = {
                "index": choice.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if return_ids and choice.index == 0:
                role["prompt_token_ids"] = generation.request["token_ids"]
            yield encoder.frame([role], generation.weight_version)
        pending = [first] if first is not None else []
        while True:
            if pending:
                delta = pending.pop()
            else:
                delta = await anext(deltas, None)
                if delta is None:
                    break
            choice, text, token_ids, logprobs, finish, version = delta
            if not text and finish is None and not (return_ids and token_ids):
                continue
            delta_body: dict[str, Any] = {"content": text} if text else {}
            if finish is not None and choice.tool_calls:
                delta_body["tool_calls"] = [
                    call.as_openai(i) for i, call in enumerate(choice.tool_calls)
                ]
            item: dict[str, Any] = {
                "index": choice.index,
                "delta": delta_body,
                "logprobs": chat_logprobs(model, logprobs) if logprobs else None,
                "finish_reason": finish,
            }
            if return_ids:
                item["token_ids"] = token_ids
            usage = generation.usage() if continuous_usage else None
            yield encoder.frame([item], version, usage)
        await generation.upload_metadata(uploader)
        if include_usage:
            yield encoder.frame([], generation.weight_version, generation.usage())
        yield DONE_FRAME

    return EventStreamResponse(
        with_error_frame(frames()),
        keepalive_s=generation.gateway.settings.sse_keepalive_s,
    )
