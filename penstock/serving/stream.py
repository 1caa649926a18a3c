"""The one response path of chat and completions: the stream loop and the non-stream fold.

A response is made of one or more :class:`Generation` (chat: one; completions: one per
prompt) whose deltas are interleaved. The endpoints differ only in their
:class:`ResponseFormat`: how a delta becomes a stream choice, how a finished choice becomes
a response choice, the object names and what precedes the first delta.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

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


class StreamFormat(Protocol):
    """What sets one endpoint's streams apart from the other's."""

    id_prefix: str
    chunk_object: str
    response_object: str

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        """Stream choices sent before the first delta, each in its own chunk."""

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        """The delta as a stream choice; None when it shows the client nothing."""


class ResponseFormat(StreamFormat, Protocol):
    """A format whose non-stream answer is made of choices, as OpenAI's are."""

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        """A finished choice as a choice of the non-stream response."""

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        """Top-level fields the non-stream response adds after the common ones."""


# A format may also define ``encoder(plan)`` (its own stream framing, with
# ``ChunkEncoder.frame``'s signature) and ``reshape(response)`` (its own non-stream body);
# without them the OpenAI chunk and response shapes apply. With the OpenAI framing it may
# define ``text_only(delta)`` and ``text_choice(index)``: a delta that is text only is then
# framed by ``ChunkEncoder.text_frame``, the choice's constant bytes encoded once.
# A format whose answer is not made of choices is only a ``StreamFormat`` and defines
# ``async finished(generations)``, the whole non-stream body once every delta is in, and
# ``async closing(generations)``, the stream items sent after the last delta.


def shows_anything(text: str, delta: Delta, with_token_ids: bool) -> bool:
    """Whether a stream choice for ``delta`` tells the client something new."""
    return bool(text or delta.finish_reason is not None or (with_token_ids and delta.token_ids))


@dataclass(slots=True)
class ResponsePlan:
    """One chat or completions response, ready to run."""

    format: StreamFormat
    generations: list[Generation]
    body: SamplingFields
    uploader: MetadataUploader | None
    deadline: Deadline | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    response_id: str = field(init=False)

    def __post_init__(self) -> None:
        # As random as ``uuid4().hex``, without building a UUID.
        self.response_id = self.format.id_prefix + os.urandom(16).hex()


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


class _Framing:
    """How one stream's deltas become frames: the encoder and what the format says."""

    __slots__ = ("continuous_usage", "encoder", "format", "generations", "text_choice", "text_only")

    def __init__(self, plan: ResponsePlan, continuous_usage: bool) -> None:
        fmt = plan.format
        custom_encoder = getattr(fmt, "encoder", None)
        self.encoder: Any = (
            custom_encoder(plan)
            if custom_encoder is not None
            else ChunkEncoder(
                plan.response_id,
                fmt.chunk_object,
                plan.created,
                plan.body.model,
                plan.generations[0].gateway.system_fingerprint,
            )
        )
        self.format = fmt
        self.generations = plan.generations
        self.continuous_usage = continuous_usage
        self.text_only = getattr(fmt, "text_only", None)
        if custom_encoder is not None or continuous_usage:
            self.text_only = None
        self.text_choice = getattr(fmt, "text_choice", None)

    def encode(self, delta: Delta) -> bytes:
        text_only = self.text_only
        if text_only is not None and text_only(delta):
            index, version = delta.choice.index, delta.weight_version
            text_frame: bytes = self.encoder.text_frame(
                self.text_choice, index, delta.text, version
            )
            return text_frame
        item = self.format.chunk_choice(delta)
        if item is None:
            return b""
        running = usage(self.generations) if self.continuous_usage else None
        frame: bytes = self.encoder.frame([item], delta.weight_version, running)
        return frame

    def opening(self, first: Delta | None) -> bytes:
        """The prelude's chunks and the first delta's, to leave in one write."""
        version = self.generations[-1].weight_version
        prelude = self.format.prelude(self.generations)
        # vLLM's continuous usage is on every chunk, the role chunk too.
        running = usage(self.generations) if self.continuous_usage else None
        opening = b"".join(self.encoder.frame([item], version, running) for item in prelude)
        return opening + self.encode(first) if first is not None else opening


async def _stream(plan: ResponsePlan) -> Response:
    generations = plan.generations
    options = plan.body.stream_options
    framing = _Framing(plan, bool(options and options.continuous_usage_stats))
    deltas = _deltas(generations)
    deadline = plan.deadline
    # Wait for the engine's first output before committing to 200, so errors the engine
    # raises at once (bad parameters) and a deadline passing in the queue still get their
    # real status.
    if deadline is None:
        first = await anext(deltas, None)
    else:
        first = await deadline.within(anext(deltas, None))
    try:
        # The prelude's chunks and the first delta's: they leave with the response start.
        opening = framing.opening(first)
    except Exception:
        # Nothing is sent yet, so the error answers the request; the engine's ends here.
        if deadline is not None:
            deadline.close()
        await deltas.aclose()
        raise
    frames = _frames(
        framing,
        first is not None,
        deltas,
        deadline,
        plan.uploader,
        include_usage=bool(options and options.include_usage),
    )
    return EventStreamResponse(
        frames,
        opening=opening,
        keepalive_s=generations[0].gateway.settings.sse_keepalive_s,
    )


async def _frames(
    framing: _Framing,
    more: bool,
    deltas: AsyncGenerator[Delta, None],
    deadline: Deadline | None,
    uploader: MetadataUploader | None,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The one generator between the engine's chunks and the wire (each layer of async
    generators costs every chunk a resumption), after the opening frames (``more``: the
    engine's deltas did not end before the first). Its arguments are what it needs of the
    plan, not the plan: the request body the plan holds is not kept while it streams.
    Errors after the first byte end the stream here, as ``with_error_frame`` would."""
    generations = framing.generations
    try:
        try:
            encode = framing.encode
            # ``encode``'s text-only case taken here: a call less for most chunks.
            text_only, text_choice = framing.text_only, framing.text_choice
            text_frame: Any = framing.encoder.text_frame if text_only is not None else None
            # ``__anext__`` rather than ``anext(deltas, None)``: no wrapper per chunk.
            next_delta = deltas.__anext__
            while more:
                try:
                    if deadline is None:
                        delta = await next_delta()
                    else:
                        delta = await deadline.within(next_delta())
                except StopAsyncIteration:
                    break
                if text_only is not None and text_only(delta):
                    frame = text_frame(
                        text_choice, delta.choice.index, delta.text, delta.weight_version
                    )
                else:
                    frame = encode(delta)
                if frame:
                    yield frame
        finally:
            if deadline is not None:
                deadline.close()
            # A deadline can end the loop between waits, with the engine request still
            # open: close it now rather than whenever the generator is collected.
            await deltas.aclose()
        await _upload_metadata(generations, uploader)
        closing = getattr(framing.format, "closing", None)
        if closing is not None:
            yield framing.encoder.frame(await closing(generations), generations[-1].weight_version)
        if include_usage:
            yield framing.encoder.frame([], generations[-1].weight_version, usage(generations))
        yield DONE_FRAME
    except Exception as exc:
        for frame in final_frames(exc):
            yield frame


async def _fold(plan: ResponsePlan) -> dict[str, Any]:
    generations = plan.generations
    async for _ in _deltas(generations):
        pass
    await _upload_metadata(generations, plan.uploader)
    finished = getattr(plan.format, "finished", None)
    if finished is not None:
        answer: dict[str, Any] = await finished(generations)
        return answer
    fmt = cast(ResponseFormat, plan.format)
    response: dict[str, Any] = {
        "id": plan.response_id,
        "object": fmt.response_object,
        "created": plan.created,
        # As the client named it: an alias stays an alias.
        "model": plan.body.model,
        "system_fingerprint": generations[0].gateway.system_fingerprint,
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
