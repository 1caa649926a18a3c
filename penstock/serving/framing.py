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
from penstock.schemas.fields import ignored_fields_header
from penstock.serving.sse import DONE_FRAME, disconnect_signal

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A choice or a usage object, as a frame carries it.
JSONObject = dict[str, Any]


# Stands for the text in a choice template of :meth:`ChunkEncoder.text_frame`.
TEXT_SLOT = "\x00text\x00"
_ENCODED_TEXT_SLOT = orjson.dumps(TEXT_SLOT)


class ChunkEncoder:
    """Encodes stream chunks whose id/object/created/model never change.

    The constant head is encoded once; per chunk only the choices (and the rare tail
    fields) are serialized.
    """

    __slots__ = ("_head", "_text_around", "_text_key", "_texts")

    def __init__(
        self, response_id: str, obj: str, created: int, model: str, fingerprint: str
    ) -> None:
        head = orjson.dumps(
            {
                "id": response_id,
                "object": obj,
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
            }
        )
        self._head = b"data: " + head[:-1] + b',"choices":'
        # The bytes around the text of the last choice index and weight version framed by
        # ``text_frame``; the others' (several choices, a new weight version) in ``_texts``,
        # made only then: a one-choice stream holds no dict of them.
        self._text_key: tuple[int, str | None] | None = None
        self._text_around = (b"", b"")
        self._texts: dict[tuple[int, str | None], tuple[bytes, bytes]] | None = None

    def frame(
        self, choices: list[JSONObject], weight_version: str | None, usage: JSONObject | None = None
    ) -> bytes:
        body = self._head + orjson.dumps(choices) + _version_tail(weight_version)
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
        key = (index, weight_version)
        if key != self._text_key:
            self._switch_text_choice(key, template)
        before, after = self._text_around
        return before + orjson.dumps(text) + after

    def _switch_text_choice(
        self, key: tuple[int, str | None], template: Callable[[int], dict[str, Any]]
    ) -> None:
        if self._text_key is not None:
            if self._texts is None:
                self._texts = {}
            self._texts[self._text_key] = self._text_around
        around = self._texts.get(key) if self._texts is not None else None
        if around is None:
            index, weight_version = key
            before, _, after = orjson.dumps([template(index)]).partition(_ENCODED_TEXT_SLOT)
            around = (self._head + before, after + _version_tail(weight_version) + b"}\n\n")
        self._text_key, self._text_around = key, around


def _version_tail(weight_version: str | None) -> bytes:
    return b',"weight_version":' + orjson.dumps(weight_version)


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
    response = Response(orjson.dumps(content), media_type="application/json")
    ignored = ignored_fields_header()
    if ignored is not None:
        response.raw_headers.append(ignored)
    return response


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
