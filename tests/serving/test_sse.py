"""The event-stream response: the start through the middleware chain, frames to the wire."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

from penstock.app.middleware import WireSend
from penstock.serving.sse import (
    DISCONNECT_KEY,
    DONE_FRAME,
    FRAME_WRITER_KEY,
    KEEPALIVE_FRAME,
    WIRE_SEND_KEY,
    DisconnectSignal,
    EventStreamResponse,
)


async def frames() -> AsyncIterator[bytes]:
    yield b"data: 1\n\n"
    yield DONE_FRAME


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_frames_skip_the_chain_when_the_wire_send_is_known() -> None:
    chain: list[dict[str, Any]] = []
    wire: list[dict[str, Any]] = []

    async def through_chain(message: dict[str, Any]) -> None:
        chain.append(message)

    async def server_send(message: dict[str, Any]) -> None:
        wire.append(message)

    response = EventStreamResponse(frames(), keepalive_s=0)
    scope = {"type": "http", WIRE_SEND_KEY: server_send}
    await response(scope, never_disconnects, through_chain)
    assert [m["type"] for m in chain] == ["http.response.start"]
    assert [m["body"] for m in wire] == [b"data: 1\n\n", DONE_FRAME]
    # The last frame ends the body: one message, one write.
    assert wire[-1]["more_body"] is False


async def test_without_it_every_message_goes_through_the_chain() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await EventStreamResponse(frames(), keepalive_s=0)({"type": "http"}, never_disconnects, send)
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", DONE_FRAME]


async def test_wire_send_leaves_the_server_send_in_http_scopes_only() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(dict(scope))

    async def send(message: dict[str, Any]) -> None:
        return None

    wrapped = WireSend(app)
    await wrapped({"type": "http"}, never_disconnects, send)
    await wrapped({"type": "lifespan"}, never_disconnects, send)
    assert seen[0][WIRE_SEND_KEY] is send
    assert WIRE_SEND_KEY not in seen[1]


class _ServerCycle:
    """What uvicorn's request cycle is to the app: the holder of the scope, whose method
    is the send."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"type": "http"}

    async def send(self, message: dict[str, Any]) -> None:
        return None


async def test_a_request_through_wire_send_is_freed_without_the_garbage_collector() -> None:
    cycle = _ServerCycle()
    held: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        held.append(scope[WIRE_SEND_KEY] is send)

    await WireSend(app)(cycle.scope, never_disconnects, cycle.send)
    dropped = weakref.ref(cycle)
    gc.disable()
    try:
        del cycle
        assert dropped() is None
    finally:
        gc.enable()
    assert held == [True]


async def test_a_disconnect_while_waiting_for_a_frame_ends_the_producer_in_one_task() -> None:
    """The server's signal cancels the writer where it waits; no watcher task is made."""
    closed = asyncio.Event()
    waiting = asyncio.Event()

    async def quiet_engine() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            waiting.set()
            await asyncio.Event().wait()
            yield b"data: never\n\n"
        finally:
            closed.set()

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    signal = DisconnectSignal()
    response = EventStreamResponse(quiet_engine(), keepalive_s=0)
    scope = {"type": "http", DISCONNECT_KEY: signal}
    before = len(asyncio.all_tasks())
    writer = asyncio.ensure_future(response(scope, never_disconnects, send))
    await asyncio.wait_for(waiting.wait(), 5)
    assert len(asyncio.all_tasks()) == before + 1
    signal.fire()
    await asyncio.wait_for(writer, 5)
    assert closed.is_set()
    assert response.disconnected
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n"]


async def test_idle_streams_get_keepalive_comments_between_frames() -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(0.25)
        yield DONE_FRAME

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", DISCONNECT_KEY: DisconnectSignal()}
    await EventStreamResponse(slow(), keepalive_s=0.1)(scope, never_disconnects, send)
    bodies = [m.get("body") for m in sent]
    assert bodies[:2] == [None, b"data: 1\n\n"]
    assert bodies[-1] == DONE_FRAME
    assert KEEPALIVE_FRAME in bodies[2:-1]


async def test_each_idle_stream_gets_its_keepalive_after_another_one_ends() -> None:
    """The open streams share one keep-alive timer: one ending leaves the others' on."""

    async def idle_for(seconds: float) -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(seconds)
        yield DONE_FRAME

    def recorder() -> tuple[list[bytes], Any]:
        bodies: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message["body"])

        return bodies, send

    short_bodies, short_send = recorder()
    long_bodies, long_send = recorder()
    short = EventStreamResponse(idle_for(0.01), keepalive_s=0.1)
    long = EventStreamResponse(idle_for(0.45), keepalive_s=0.1)
    await asyncio.gather(
        short({"type": "http", DISCONNECT_KEY: DisconnectSignal()}, never_disconnects, short_send),
        long({"type": "http", DISCONNECT_KEY: DisconnectSignal()}, never_disconnects, long_send),
    )
    assert short_bodies == [b"data: 1\n\n", DONE_FRAME]
    assert long_bodies[0] == b"data: 1\n\n"
    assert long_bodies[-1] == DONE_FRAME
    # Quiet for 0.45 s with a 0.1 s interval: a comment every 0.1-0.125 s.
    assert long_bodies[1:-1].count(KEEPALIVE_FRAME) >= 3


# What the fake writer below puts on the wire where the response start is held.
HELD = b"<start held>"
OPENING = b"data: opening\n\n"


class Writer:
    """A frame writer that takes every frame but those in ``refused``, writing to
    ``wire`` as the server's ``send`` below does."""

    def __init__(self, wire: list[bytes], refused: frozenset[bytes] = frozenset()) -> None:
        self.wire = wire
        self.refused = refused
        self.written: list[bytes] = []

    def hold_start(self) -> None:
        self.wire.append(HELD)

    def write(self, frame: bytes) -> bool:
        if frame in self.refused:
            return False
        self.written.append(frame)
        self.wire.append(frame)
        return True


async def many_frames() -> AsyncIterator[bytes]:
    for i in range(3):
        yield b"data: %d\n\n" % i
    yield DONE_FRAME


async def stream_through(
    writer: Writer | None, wire: list[bytes], opening: bytes = b""
) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            wire.append(b"<start>")
        if message["type"] == "http.response.body":
            wire.append(message["body"])

    scope: dict[str, Any] = {"type": "http"}
    if writer is not None:
        scope[FRAME_WRITER_KEY] = writer
    response = EventStreamResponse(many_frames(), opening=opening, keepalive_s=0)
    await response(scope, never_disconnects, send)
    return sent


async def test_the_opening_frames_are_written_with_the_start_held_for_them() -> None:
    wire: list[bytes] = []
    await stream_through(Writer(wire), wire, OPENING)
    frames = [OPENING, b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", DONE_FRAME]
    assert wire == [HELD, b"<start>", *frames]


async def test_the_opening_frames_come_first_whichever_way_they_leave() -> None:
    refused_wire: list[bytes] = []
    await stream_through(Writer(refused_wire, refused=frozenset({OPENING})), refused_wire, OPENING)
    no_writer_wire: list[bytes] = []
    await stream_through(None, no_writer_wire, OPENING)
    frames = [OPENING, b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", DONE_FRAME]
    assert refused_wire == [HELD, b"<start>", *frames]
    assert no_writer_wire == [b"<start>", *frames]


async def test_no_start_is_held_without_opening_frames() -> None:
    wire: list[bytes] = []
    await stream_through(Writer(wire), wire)
    assert HELD not in wire


async def test_the_connections_writer_takes_the_frames_it_can_write_at_once() -> None:
    wire: list[bytes] = []
    writer = Writer(wire)
    sent = await stream_through(writer, wire)
    assert writer.written == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    # The start and the body's last message are ASGI messages still.
    assert [m.get("body") for m in sent] == [None, DONE_FRAME]
    assert sent[-1]["more_body"] is False


async def test_a_frame_the_writer_refuses_is_sent_in_its_place() -> None:
    wire: list[bytes] = []
    writer = Writer(wire, refused=frozenset({b"data: 1\n\n"}))
    await stream_through(writer, wire)
    assert wire == [b"<start>", b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", DONE_FRAME]
    assert writer.written == [b"data: 0\n\n", b"data: 2\n\n"]
