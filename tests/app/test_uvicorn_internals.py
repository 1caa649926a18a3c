"""The parts of uvicorn's httptools protocol and request cycle that
:mod:`penstock.app.connections` builds on: their names, signatures and the behaviour it
relies on. uvicorn treats them as internal, so a release may change them; this fails,
naming what moved, before a connection does."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from penstock.app.connections import CloseDelimitedCycle, ConnectionLimits, guarded_protocol
from penstock.serving.sse import FRAME_WRITER_KEY
from tests.app.test_frame_writer import RecordingTransport

# The protocol's callbacks the guarded protocol overrides, with their parameters.
PROTOCOL_CALLBACKS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
}
# What it reads or sets on a connection, once it is made.
PROTOCOL_STATE = ("app", "connections", "cycle", "flow", "loop", "scope", "transport")
# What it reads or sets on a request's cycle.
CYCLE_STATE = (
    "body",
    "chunked_encoding",
    "disconnected",
    "flow",
    "keep_alive",
    "message_event",
    "more_body",
    "on_response",
    "response_complete",
    "response_started",
    "scope",
    "transport",
)
REQUEST = b"POST /v1/completions HTTP/1.0\r\nhost: penstock\r\ncontent-length: 4\r\n\r\n"


def test_the_callbacks_it_overrides_keep_their_signatures() -> None:
    found = {
        name: list(inspect.signature(method).parameters) if method is not None else None
        for name in PROTOCOL_CALLBACKS
        for method in [getattr(HttpToolsProtocol, name, None)]
    }
    changed = {name: params for name, params in found.items() if params != PROTOCOL_CALLBACKS[name]}
    assert changed == {}
    send = inspect.signature(RequestResponseCycle.send)
    assert list(send.parameters) == ["self", "message"]
    assert inspect.iscoroutinefunction(RequestResponseCycle.send)
    # A cycle's class is swapped for HTTP/1.0 requests: both must lay out alike.
    assert "__slots__" not in vars(RequestResponseCycle)
    assert httptools_impl.RequestResponseCycle is RequestResponseCycle


def test_a_connection_and_its_cycle_hold_what_the_guarded_protocol_uses() -> None:
    asyncio.run(_drive_one_request())


async def _drive_one_request() -> None:
    received: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        received.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, http=guarded_protocol(ConnectionLimits(5, 5, 0)), lifespan="off")
    config.load()
    state = ServerState()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = RecordingTransport()
    protocol.connection_made(transport)
    missing = [name for name in PROTOCOL_STATE if not hasattr(protocol, name)]
    assert missing == []
    assert protocol in state.connections and protocol.transport is transport
    assert isinstance(protocol.flow, FlowControl)
    assert not protocol.flow.read_paused and not protocol.flow.write_paused

    protocol.data_received(REQUEST + b"bo")
    cycle = protocol.cycle
    missing = [name for name in CYCLE_STATE if not hasattr(cycle, name)]
    assert missing == []
    # The request's URL and headers as the parser handed them over.
    assert protocol.url == b"/v1/completions"
    assert protocol.headers == [(b"host", b"penstock"), (b"content-length", b"4")]
    assert type(cycle) is CloseDelimitedCycle and cycle.scope is protocol.scope
    assert protocol.scope[FRAME_WRITER_KEY].cycle is cycle  # type: ignore[typeddict-item]
    # The app's task has not run yet, so the swapped class's ``send`` is the one it gets.
    assert received == []
    protocol.data_received(b"dy")
    for _ in range(10):
        await asyncio.sleep(0)
    assert received == [{"type": "http.request", "body": b"body", "more_body": False}]
    assert b"".join(transport.written).endswith(b"\r\n\r\nok") and transport.closed
