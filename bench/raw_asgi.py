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
DELAY_S = 0.0

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


async def _read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def _chunk(head: dict[str, Any], choice: dict[str, Any], usage: Any = None) -> bytes:
    payload = {**head, "choices": [choice] if choice else [], "weight_version": None}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/live":
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
        return
    body = orjson.loads(await _read_body(receive))
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
            await asyncio.sleep(DELAY_S)
            text += f"t{i} "
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        payload = {**head, "choices": [choice], "usage": usage, "weight_version": None}
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": orjson.dumps(payload)})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    role = {"role": "assistant", "content": ""}
    first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
    await send({"type": "http.response.body", "body": _chunk(head, first), "more_body": True})
    for i in range(count):
        await asyncio.sleep(DELAY_S)
        finish = "length" if i == count - 1 else None
        choice = {"index": 0, "delta": {"content": f"t{i} "}, "logprobs": None}
        choice["finish_reason"] = finish
        frame = _chunk(head, choice)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        frame = _chunk(head, {}, usage)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def main() -> None:
    global DELAY_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each token")
    parser.add_argument("--loop", default="auto", help="uvicorn's --loop: auto, asyncio, uvloop")
    args = parser.parse_args()
    DELAY_S = args.delay
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
    main()
