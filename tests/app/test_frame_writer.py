"""The connection's frame writer: uvicorn's bytes for a chunked body frame, or nothing
when uvicorn's ``send`` would wait or write nothing; a held response start leaves with
the body's next bytes, in one write."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from penstock.app.connections import (
    ChunkedFrameWriter,
    CloseDelimitedCycle,
    ConnectionLimits,
    guarded_protocol,
)
from penstock.serving.sse import DONE_FRAME, FRAME_WRITER_KEY, EventStreamResponse

FRAME = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


def cycle(
    method: str = "POST", keep_alive: bool = True
) -> tuple[RequestResponseCycle, RecordingTransport]:
    transport = RecordingTransport()
    scope = {"type": "http", "method": method, "http_version": "1.1", "path": "/"}
    made = RequestResponseCycle(
        scope=scope,  # type: ignore[arg-type]
        transport=transport,
        flow=FlowControl(transport),
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    return made, transport


async def started(method: str = "POST") -> tuple[RequestResponseCycle, RecordingTransport]:
    made, transport = cycle(method)
    headers = [(b"content-type", b"text/event-stream")]
    await made.send({"type": "http.response.start", "status": 200, "headers": headers})
    transport.written.clear()
    return made, transport


async def test_a_frame_is_written_as_uvicorns_send_writes_it() -> None:
    by_send, send_transport = await started()
    await by_send.send({"type": "http.response.body", "body": FRAME, "more_body": True})
    by_writer, writer_transport = await started()
    assert ChunkedFrameWriter(by_writer).write(FRAME) is True
    assert writer_transport.written == send_transport.written
    assert writer_transport.written == [b"%x\r\n" % len(FRAME) + FRAME + b"\r\n"]


async def test_it_writes_nothing_where_send_would_wait_or_drop_the_frame() -> None:
    paused, paused_transport = await started()
    paused.flow.pause_writing()
    gone, gone_transport = await started()
    gone.disconnected = True
    head, head_transport = await started("HEAD")
    not_started, not_started_transport = cycle()
    for refused, transport in [
        (paused, paused_transport),
        (gone, gone_transport),
        (head, head_transport),
        (not_started, not_started_transport),
    ]:
        assert ChunkedFrameWriter(refused).write(FRAME) is False
        assert transport.written == []


async def test_it_writes_nothing_after_the_body_ended() -> None:
    made, transport = await started()
    await made.send({"type": "http.response.body", "body": b"", "more_body": False})
    transport.written.clear()
    assert ChunkedFrameWriter(made).write(FRAME) is False
    assert transport.written == []


async def test_an_http_1_0_stream_is_written_as_is_and_ended_by_the_close() -> None:
    made, transport = cycle(keep_alive=False)
    made.__class__ = CloseDelimitedCycle
    headers = [(b"content-type", b"text/event-stream")]
    await made.send({"type": "http.response.start", "status": 200, "headers": headers})
    [head] = transport.written
    assert b"transfer-encoding" not in head and b"connection: close\r\n" in head
    transport.written.clear()
    assert ChunkedFrameWriter(made).write(FRAME) is True
    await made.send({"type": "http.response.body", "body": FRAME, "more_body": True})
    await made.send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    assert transport.written == [FRAME, FRAME, b"data: [DONE]\n\n"]
    assert transport.closed and made.response_complete
    assert ChunkedFrameWriter(made).write(FRAME) is False


async def test_an_http_1_0_response_with_a_length_is_sent_as_uvicorn_sends_it() -> None:
    made, transport = cycle(keep_alive=False)
    made.__class__ = CloseDelimitedCycle
    await made.send(JSON_START)
    await made.send({"type": "http.response.body", "body": BODY})
    assert transport.written[-1] == BODY and transport.closed
    assert ChunkedFrameWriter(made).write(FRAME) is False


SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}
BODY = b'{"object":"chat.completion"}'
JSON_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))],
}


async def test_a_held_start_leaves_with_the_first_frame_in_one_write() -> None:
    by_send, send_transport = cycle()
    await by_send.send(SSE_START)
    await by_send.send({"type": "http.response.body", "body": FRAME, "more_body": True})
    held, held_transport = cycle()
    writer = ChunkedFrameWriter(held)
    writer.hold_start()
    await held.send(SSE_START)
    assert held_transport.written == []
    assert writer.write(FRAME) is True
    assert held_transport.written == [b"".join(send_transport.written)]
    # The cycle has its transport back: later frames are written as before.
    assert held.transport is held_transport
    assert writer.write(FRAME) is True
    assert held_transport.written[1:] == send_transport.written[1:]


async def test_a_held_start_leaves_with_a_whole_body_sent_as_a_message() -> None:
    for keep_alive in (True, False):
        by_send, send_transport = cycle(keep_alive=keep_alive)
        await by_send.send(JSON_START)
        await by_send.send({"type": "http.response.body", "body": BODY})
        held, held_transport = cycle(keep_alive=keep_alive)
        ChunkedFrameWriter(held).hold_start()
        await held.send(JSON_START)
        await held.send({"type": "http.response.body", "body": BODY})
        assert len(send_transport.written) == 2
        assert held_transport.written == [b"".join(send_transport.written)]
        # Written before the connection closes, when it is not kept alive.
        assert held_transport.closed is not keep_alive
        assert held.transport is held_transport


async def test_a_held_start_is_written_when_the_response_fails_after_it() -> None:
    """uvicorn closes the transport of a response that began and then failed: the start
    it held is written first, as uvicorn had written it."""
    held, transport = cycle()
    ChunkedFrameWriter(held).hold_start()
    await held.send(SSE_START)
    held.transport.close()
    assert transport.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.closed


async def test_no_start_is_held_for_a_head_request_or_a_begun_response() -> None:
    """A HEAD response writes no body, so nothing would carry the start."""
    head, head_transport = cycle("HEAD")
    ChunkedFrameWriter(head).hold_start()
    await head.send(SSE_START)
    assert len(head_transport.written) == 1
    begun, begun_transport = await started()
    ChunkedFrameWriter(begun).hold_start()
    assert begun.transport is begun_transport


async def test_the_server_gives_each_request_a_writer_over_its_own_cycle() -> None:
    """Through a real server: the stream's frames leave by the writer, whole and in order,
    and each request's cycle is freed once it ends, with no garbage collection."""
    writers: list[ChunkedFrameWriter] = []
    answered_by: list[bool] = []

    async def frames() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"data: %d\n\n" % i
        yield DONE_FRAME

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        writer = scope[FRAME_WRITER_KEY]
        writers.append(writer)
        cycle = writer.cycle
        answered_by.append(cycle is not None and cycle.scope is scope)
        del cycle
        await EventStreamResponse(frames(), keepalive_s=0)(scope, receive, send)

    limits = ConnectionLimits(header_timeout_s=5, body_timeout_s=5, max_connections=0)
    config = uvicorn.Config(app, http=guarded_protocol(limits), lifespan="off")
    server = uvicorn.Server(config)
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    # The client's connections wait in the socket's backlog until the server accepts them.
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    gc.disable()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            bodies = [(await client.get("/")).content for _ in range(2)]
        server.should_exit = True
        await serving
        # One per request, each over the cycle that answered it (a kept-alive connection).
        assert answered_by == [True, True]
        assert writers[0] is not writers[1]
        assert [writer.cycle for writer in writers] == [None, None]
    finally:
        gc.enable()
        server.should_exit = True
        await serving
    assert bodies == [b"data: 0\n\ndata: 1\n\ndata: 2\n\n" + DONE_FRAME] * 2
