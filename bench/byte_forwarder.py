"""The ingress of the data plane design ``bench/ray_serve.py --forwarded`` measures: each
replica runs the whole gateway and the ingress forwards HTTP bytes to it (one pooled
connection per concurrent request, the body streamed through as it arrives).

    python bench/byte_forwarder.py --port 18620 --upstream http://127.0.0.1:18621
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import uvicorn

_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}


def forwarder(upstream: str) -> Any:
    client = httpx.AsyncClient(base_url=upstream, timeout=None, limits=httpx.Limits())

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
        request = client.build_request(
            scope["method"], scope["path"], headers=headers, content=body
        )
        response = await client.send(request, stream=True)
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            async for piece in response.aiter_raw():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvicorn.run(forwarder(args.upstream), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
