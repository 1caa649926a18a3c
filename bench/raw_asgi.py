"""The floor: a raw ASGI app with orjson, answering chat completions with the chunk shapes
Penstock sends, and no tokenizer, framework or metrics.

Each token costs one event-loop turn (``asyncio.sleep(delay)``), as the sample engine's
``--delay 0`` does, and each chunk is a whole dict serialized with orjson:

    python bench/raw_asgi.py --port 8100 [--delay 0]

Streams end with ``finish_reason`` on the last token, the usage chunk when
``stream_options.include_usage`` asks, and ``data: [DONE]``; non-streaming requests get
the whole ``chat.completion``. ``max_tokens`` (default 16) tokens, ``"t<i> "`` each.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import orjson
import uvicorn

DEFAULT_TOKENS = 16

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class Pace:
    """Seconds before each token (``--delay``), shared with ``work_floor.py``."""

    delay_s = 0.0


async def read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def chunk(head: dict[str, Any], choice: dict[str, Any], usage: Any = None) -> bytes:
    payload = {**head, "choices": [choice] if choice else [], "weight_version": None}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    if scope["path"] == "/live":
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
        return
    body = orjson.loads(await read_body(receive))
    count = int(body.get("max_tokens") or DEFAULT_TOKENS)
    head = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion.chunk" if body.get("stream") else "chat.completion",
        "created": int(time.time()),
        "model": body["model"],
    }
    usage = {"prompt_tokens": 8, "completion_tokens": count, "total_tokens": 8 + count}
    if not body.get("stream"):
        text = ""
        for i in range(count):
            await asyncio.sleep(Pace.delay_s)
            text += f"t{i} "
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        payload = {**head, "choices": [choice], "usage": usage, "weight_version": None}
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": orjson.dumps(payload)})
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    role = {"role": "assistant", "content": ""}
    first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
    await send({"type": "http.response.body", "body": chunk(head, first), "more_body": True})
    for i in range(count):
        await asyncio.sleep(Pace.delay_s)
        finish = "length" if i == count - 1 else None
        choice = {"index": 0, "delta": {"content": f"t{i} "}, "logprobs": None}
        choice["finish_reason"] = finish
        frame = chunk(head, choice)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        frame = chunk(head, {}, usage)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def serve(app: Any, default_port: int) -> None:
    """Serve ``app`` with the command line's ``--port``, ``--delay`` and ``--loop``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each token")
    parser.add_argument("--loop", default="auto", help="uvicorn's --loop: auto, asyncio, uvloop")
    args = parser.parse_args()
    Pace.delay_s = args.delay
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop=args.loop,
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=8192,
        limit_concurrency=None,
    )


if __name__ == "__main__":
    serve(app, 8100)
