"""The socket ``serve`` binds before the engine loads, as the connections it accepts see it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from penstock.app.server import bind_socket
from penstock.errors import ListenError


async def test_accepted_connections_have_nagle_off() -> None:
    """Nagle left on delays every small response by the client's delayed ACK."""
    listening = bind_socket("127.0.0.1", 0)
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted = transport.get_extra_info("socket")
            nodelay.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    server = await asyncio.get_running_loop().create_server(Record, sock=listening)
    try:
        port = listening.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(nodelay, timeout=10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_a_bound_port_is_refused_with_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: the port is already in use"):
            bind_socket("127.0.0.1", port)
