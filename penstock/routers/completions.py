"""``POST /v1/completions``: string, strings, token ids or lists of token ids.

A batch of prompts runs as one engine request per prompt, concurrently; choice ``index``
is ``prompt_index * n + choice``. Response extensions as for chat (see
:mod:`penstock.routers.chat`).
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
from penstock.schemas.openai import CompletionRequest
from penstock.serving.framing import (
    ChunkEncoder,
    ClientDisconnected,
    json_response,
    unless_disconnected,
    with_error_frame,
)
from penstock.serving.generation import Generation, LogprobEntry, merge
from penstock.serving.requests import (
    check_budget,
    check_common_limits,
    completion_prompts,
    generate_request,
    metadata_uploader,
)
from penstock.serving.sse import DONE_FRAME, EventStreamResponse

router = APIRouter(tags=["openai"])


def completion_logprobs(
    model: ServedModel, entries: list[LogprobEntry], text_offset: int
) -> dict[str, Any]:
    pre = model.preprocessor

    def text_of(token_id: int) -> str:
        return pre.token_text(token_id) if pre is not None else f"token_id:{token_id}"

    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, logprob, alternatives in entries:
        text = text_of(token_id)
        tokens.append(text)
        values.append(logprob)
        tops.append({text_of(alt): alt_logprob for alt, alt_logprob in alternatives} or None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise InvalidRequestError("suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of must be equal to n when given", param="best_of")


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    gateway = request.app.state.gateway
    model = gateway.resolve(body.model)
    if "completions" not in model.endpoint_types:
        raise InvalidRequestError(
            f"The model '{body.model}' does not serve completions", param="model"
        )
    check_common_limits(body, gateway.settings, model)
    _check_unsupported(body)
    uploader = metadata_uploader(body)
    prompts = completion_prompts(body, model)
    for ids in prompts:
        check_budget(len(ids), body.max_tokens, model, "prompt")
    request_id = request.state.request_id
    generations = [
        Generation(
            gateway,
            model,
            generate_request(body, model, ids, max_tokens=body.max_tokens, logprobs=body.logprobs),
            Context(
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                {"x-request-id": request_id},
                traceparent=request.headers.get("traceparent"),
            ),
            stops=body.stop_list,
            keep_text=not body.stream,
            want_logprobs=body.logprobs is not None,
            endpoint="completions",
            streaming=body.stream,
            index_offset=i * body.n,
        )
        for i, ids in enumerate(prompts)
    ]
    echoes = [_echo_text(body, model, g) for g in generations]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        return await _stream(body, model, generations, echoes, uploader, response_id, created)
    try:
        result = await unless_disconnected(
            request, _complete(body, model, generations, echoes, uploader, response_id, created)
        )
    except ClientDisconnected:
        return Response(status_code=499)
    return json_response(result)


def _echo_text(body: CompletionRequest, model: ServedModel, generation: Generation) -> str:
    if not body.echo:
        return ""
    if model.preprocessor is None:
        raise InvalidRequestError(
            "echo needs a tokenizer to render the prompt; none is configured", param="echo"
        )
    detokenizer = model.preprocessor.new_detokenizer(skip_special_tokens=False)
    return "".join(detokenizer.step(t) for t in generation.request["token_ids"])


def _usage(generations: list[Generation]) -> dict[str, Any]:
    prompt = sum(g.prompt_tokens for g in generations)
    completion = sum(g.completion_tokens for g in generations)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _complete(
    body: CompletionRequest,
    model: ServedModel,
    generations: list[Generation],
    echoes: list[str],
    uploader: MetadataUploader | None,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    async for _ in merge([g.deltas() for g in generations]):
        pass
    for generation in generations:
        await generation.upload_metadata(uploader)
    choices = []
    for generation, echo in zip(generations, echoes, strict=True):
        for choice in generation.choices:
            item: dict[str, Any] = {
                "index": choice.index,
                "text": echo + choice.text,
                "logprobs": completion_logprobs(model, choice.logprobs, len(echo))
                if choice.logprobs is not None
                else None,
                "finish_reason": choice.finish_reason,
                "weight_versions": choice.weight_version_segments(),
            }
            if body.return_token_ids:
                item["prompt_token_ids"] = generation.request["token_ids"]
                item["token_ids"] = choice.token_ids
            choices.append(item)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage(generations),
        "weight_version": generations[-1].weight_version,
    }


async def _stream(
    body: CompletionRequest,
    model: ServedModel,
    generations: list[Generation],
    echoes: list[str],
    uploader: MetadataUploader | None,
    response_id: str,
    created: int,
) -> Response:
    encoder = ChunkEncoder(response_id, "text_completion", created, body.model)
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(options and options.continuous_usage_stats)
    return_ids = body.return_token_ids
    deltas = merge([g.deltas() for g in generations])
    first = await anext(deltas, None)
    pending_echo = {
        choice.index: echo
        for generation, echo in zip(generations, echoes, strict=True)
        for choice in generation.choices
        if echo
    }
    offsets: dict[int, int] = {}

    async def frames() -> Any:
        pending = [first] if first is not None else []
        while True:
            if pending:
                delta = pending.pop()
            else:
                delta = await anext(deltas, None)
                if delta is None:
                    break
            choice, text, token_ids, logprobs, finish, version = delta
            text = pending_echo.pop(choice.index, "") + text
            if not text and finish is None and not (return_ids and token_ids):
                continue
            item: dict[str, Any] = {
                "index": choice.index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
            }
            if logprobs:
                start = offsets.get(choice.index, 0)
                item["logprobs"] = completion_logprobs(model, logprobs, start)
                offsets[choice.index] = start + len(text)
            if return_ids:
                item["token_ids"] = token_ids
            usage = _usage(generations) if continuous_usage else None
            yield encoder.frame([item], version, usage)
        for generation in generations:
            await generation.upload_metadata(uploader)
        if include_usage:
            yield encoder.frame([], generations[-1].weight_version, _usage(generations))
        yield DONE_FRAME

    return EventStreamResponse(
        with_error_frame(frames()),
        keepalive_s=generations[0].gateway.settings.sse_keepalive_s,
    )
