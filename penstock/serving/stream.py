"""The one response path of chat and completions: the stream loop and the non-stream fold.

A response is made of one or more :class:`Generation` (chat: one; completions: one per
prompt) whose deltas are interleaved. The endpoints differ only in their
:class:`ResponseFormat`: how a delta becomes a stream choice, how a finished choice becomes
a response choice, the object names and what precedes the first delta.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from penstock.metadata_upload import MetadataUploader
from penstock.schemas.openai import SamplingFields
from penstock.serving.choice import ChoiceState, Delta
from penstock.serving.deadline import Deadline
from penstock.serving.framing import (
    ChunkEncoder,
    final_frames,
    json_response,
    unless_disconnected,
)
from penstock.serving.generation import Generation, merge, usage
from penstock.serving.sse import DONE_FRAME, EventStreamResponse


class ResponseFormat(Protocol):
    """What sets one endpoint's responses apart from the other's."""

    id_prefix: str
    chunk_object: str
    response_object: str

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        """Stream choices sent before the first delta, each in its own chunk."""

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        """The delta as a stream choice; None when it shows the client nothing."""

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        """A finished choice as a choice of the non-stream response."""

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        """Top-level fields the non-stream response adds after the common ones."""


# A format may also define ``encoder(plan)`` (its own stream framing, with
# ``ChunkEncoder.frame``'s signature) and ``reshape(response)`` (its own non-stream body);
# without them the OpenAI chunk and response shapes apply. With the OpenAI framing it may
# define ``text_only(delta)`` and ``text_choice(index)``: a delta that is text only is then
# framed by ``ChunkEncoder.text_frame``, the choice's constant bytes encoded once.


def shows_anything(text: str, delta: Delta, with_token_ids: bool) -> bool:
    """Whether a stream choice for ``delta`` tells the client something new."""
    return bool(text or delta.finish_reason is not None or (with_token_ids and delta.token_ids))


@dataclass(slots=True)
class ResponsePlan:
    """One chat or completions response, ready to run."""

    format: ResponseFormat
    generations: list[Generation]
    body: SamplingFields
    uploader: MetadataUploader | None
    deadline: Deadline | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    response_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.response_id = self.format.id_prefix + uuid.uuid4().hex


async def respond(request: Request, plan: ResponsePlan) -> Response:
    """Run the plan: a stream of chunks, or one JSON response once every choice is done."""
    # Read once by the access log after the response has ended, streams included.
    request.state.usage = partial(usage, plan.generations)
    if plan.body.stream:
        return await _stream(plan)
    deadline = plan.deadline
    if deadline is None:
        return json_response(await unless_disconnected(request, _fold(plan)))
    try:
        return json_response(await unless_disconnected(request, deadline.within(_fold(plan))))
    finally:
        deadline.close()


async def _stream(plan: ResponsePlan) -> Response:
    fmt = plan.format
    generations = plan.generations
    custom_encoder = getattr(fmt, "encoder", None)
    encoder = (
        custom_encoder(plan)
        if custom_encoder is not None
        else ChunkEncoder(plan.response_id, fmt.chunk_object, plan.created, plan.body.model)
    )
    options = plan.body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous_usage = bool(options and options.continuous_usage_stats)
    text_only = getattr(fmt, "text_only", None)
    if custom_encoder is not None or continuous_usage:
        text_only = None
    text_choice = getattr(fmt, "text_choice", None)
    deltas = _deltas(generations)
    deadline = plan.deadline
    # ``frames`` takes what it needs from the plan, not the plan: the request body it holds
    # is not kept for the length of the stream.
    uploader = plan.uploader
    # Wait for the engine's first output before committing to 200, so errors the engine
    # raises at once (bad parameters) and a deadline passing in the queue still get their
    # real status.
    if deadline is None:
        first = await anext(deltas, None)
    else:
        first = await deadline.within(anext(deltas, None))

    def encode(delta: Delta) -> bytes:
        if text_only is not None and text_only(delta):
            index, version = delta.choice.index, delta.weight_version
            return encoder.text_frame(text_choice, index, delta.text, version)
        item = fmt.chunk_choice(delta)
        if item is None:
            return b""
        running = usage(generations) if continuous_usage else None
        return encoder.frame([item], delta.weight_version, running)

    # One generator between the engine's chunks and the wire: each layer of async
    # generators costs every chunk a resumption. Errors after the first byte end the
    # stream here, as ``with_error_frame`` would.
    async def frames() -> AsyncIterator[bytes]:
        try:
            version = generations[-1].weight_version
            opening = [encoder.frame([item], version) for item in fmt.prelude(generations)]
            # ``__anext__`` rather than ``anext(deltas, None)``: no wrapper per chunk.
            next_delta = deltas.__anext__
            try:
                # The first delta is at hand: it leaves in the prelude's write.
                frame = b"".join(opening) + (encode(first) if first is not None else b"")
                more = first is not None
                while True:
                    if frame:
                        yield frame
                    if not more:
                        break
                    try:
                        if deadline is None:
                            delta = await next_delta()
                        else:
                            delta = await deadline.within(next_delta())
                    except StopAsyncIteration:
                        break
                    frame = encode(delta)
            finally:
                if deadline is not None:
                    deadline.close()
                # A deadline can end the loop between waits, with the engine request still
                # open: close it now rather than whenever the generator is collected.
                await deltas.aclose()
            await _upload_metadata(generations, uploader)
            if include_usage:
                yield encoder.frame([], generations[-1].weight_version, usage(generations))
            yield DONE_FRAME
        except Exception as exc:
            for frame in final_frames(exc):
                yield frame

    return EventStreamResponse(
        frames(),
        keepalive_s=generations[0].gateway.settings.sse_keepalive_s,
    )


async def _fold(plan: ResponsePlan) -> dict[str, Any]:
    generations = plan.generations
    async for _ in _deltas(generations):
        pass
    await _upload_metadata(generations, plan.uploader)
    fmt = plan.format
    response: dict[str, Any] = {
        "id": plan.response_id,
        "object": fmt.response_object,
        "created": plan.created,
        # As the client named it: an alias stays an alias.
        "model": plan.body.model,
        "choices": [
            fmt.response_choice(generation, choice)
            for generation in generations
            for choice in generation.choices
        ],
        "usage": usage(generations),
        "weight_version": generations[-1].weight_version,
    }
    response.update(fmt.response_fields(generations))
    reshape = getattr(fmt, "reshape", None)
    return reshape(response) if reshape is not None else response


def _deltas(generations: list[Generation]) -> AsyncGenerator[Delta, None]:
    """The deltas of every generation; one generation's own, without a merging layer."""
    if len(generations) == 1:
        return generations[0].deltas()  # type: ignore[return-value]
    return merge([generation.deltas() for generation in generations])


async def _upload_metadata(
    generations: list[Generation], uploader: MetadataUploader | None
) -> None:
    for generation in generations:
        await generation.upload_metadata(uploader)
