"""Bytes on the wire for the serving routes: chunk encoding, error frames, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from penstock.errors import ClientClosedRequest, InternalServerError, PenstockError
from penstock.serving.sse import DONE_FRAME, disconnect_signal

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Stands for the text in a choice template of :meth:`ChunkEncoder.text_frame`.
TEXT_SLOT = "\x00text\x00"
_ENCODED_TEXT_SLOT = orjson.dumps(TEXT_SLOT)


class ChunkEncoder:
    """Encodes stream chunks whose id/object/created/model never change.

    The constant head is encoded once; per chunk only the choices (and the rare tail
    fields) are serialized.
    """

    __slots__ = ("_head", "_text_choices", "_version_tails")

    def __init__(self, response_id: str, obj: str, created: int, model: str) -> None:
        head = orjson.dumps({"id": response_id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":'
        self._version_tails: dict[str | None, bytes] = {}
        self._text_choices: dict[tuple[int, str | None], tuple[bytes, bytes]] = {}

    def frame(
        self,
        choices: list[dict[str, Any]],
        weight_version: str | None,
        usage: dict[str, Any] | None = None,
    ) -> bytes:
        body = self._head + orjson.dumps(choices) + self._version_tail(weight_version)
        if usage is not None:
            body += b',"usage":' + orjson.dumps(usage)
        return body + b"}\n\n"

    def text_frame(
        self,
        template: Callable[[int], dict[str, Any]],
        index: int,
        text: str,
        weight_version: str | None,
    ) -> bytes:
        """``frame([choice], weight_version)`` for a choice that differs from
        ``template(index)`` only in its text, where the template holds :data:`TEXT_SLOT`:
        the frame's other bytes are encoded once per index and weight version, the text
        alone per chunk."""
        around = self._text_choices.get((index, weight_version))
        if around is None:
            before, _, after = orjson.dumps([template(index)]).partition(_ENCODED_TEXT_SLOT)
            after += self._version_tail(weight_version) + b"}\n\n"
            around = self._text_choices[(index, weight_version)] = (self._head + before, after)
        before, after = around
        return before + orjson.dumps(text) + after

    def _version_tail(self, weight_version: str | None) -> bytes:
        tail = self._version_tails.get(weight_version)
        if tail is None:
            tail = b',"weight_version":' + orjson.dumps(weight_version)
            self._version_tails[weight_version] = tail
        return tail


def error_frame(error: PenstockError) -> bytes:
    return b"data: " + orjson.dumps(error.envelope()) + b"\n\n"


def final_frames(exc: Exception) -> tuple[bytes, bytes]:
    """What ends a stream that failed after its first byte: one error frame and DONE."""
    if isinstance(exc, PenstockError):
        if exc.status_code >= 500:
            logger.error("stream failed: %s", exc.message)
        return error_frame(exc), DONE_FRAME
    logger.error("stream failed", exc_info=exc)
    return error_frame(InternalServerError()), DONE_FRAME


async def with_error_frame(frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """After the first byte an error can't change the status: send one error frame + DONE."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:
        for frame in final_frames(exc):
            yield frame


def json_response(content: dict[str, Any]) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (which aborts the engine).

    Raises :class:`ClientClosedRequest` (499) once the cancelled work has wound down, so
    every non-streaming route answers a disconnect the same way. The work runs in the
    calling task; the disconnect cancels it (see :class:`DisconnectSignal`).
    """
    signal, watcher = disconnect_signal(request.scope, request.receive)
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def cancel() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    try:
        if signal.lost:
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientClosedRequest("The client closed the request")
        signal.watch(cancel)
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientClosedRequest("The client closed the request") from None
        raise
    finally:
        signal.watch(None)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
