"""What the connection guards add to one request: ``GuardedHttpProtocol`` against uvicorn's
plain httptools protocol, both fed whole keep-alive requests in-process (no sockets) and
answering from a no-op ASGI app, in microseconds per request."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from penstock.app.connections import ConnectionLimits, guarded_protocol

REQUESTS = 20_000
ROUNDS = 5
REQUEST = b"POST /v1/completions HTTP/1.1\r\nhost: penstock\r\ncontent-length: 2\r\n\r\n{}"


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name)

    def write(self, data: Any) -> None:
        return None

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def per_request_us(protocol_class: type[asyncio.Protocol]) -> float:
    config = uvicorn.Config(app, http=protocol_class, log_level="warning", access_log=False)
    config.load()
    state = ServerState()
    protocol: Any = protocol_class(config=config, server_state=state, app_state={})  # type: ignore[call-arg]
    protocol.connection_made(Transport())
    started = time.perf_counter()
    for _ in range(REQUESTS):
        protocol.data_received(REQUEST)
        await asyncio.gather(*state.tasks)
    elapsed = time.perf_counter() - started
    protocol.connection_lost(None)
    return elapsed / REQUESTS * 1e6


async def main() -> dict[str, float]:
    guarded = guarded_protocol(ConnectionLimits(10.0, 30.0, 2048))
    plain: list[float] = []
    ours: list[float] = []
    for _ in range(ROUNDS):
        plain.append(await per_request_us(HttpToolsProtocol))
        ours.append(await per_request_us(guarded))
    return {
        "uvicorn_us_per_request": round(statistics.median(plain), 2),
        "guarded_us_per_request": round(statistics.median(ours), 2),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
