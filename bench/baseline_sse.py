"""A minimal FastAPI + sse-starlette server streaming N fake chat chunks: the floor that
``bench/load.py`` numbers for Penstock are compared with.

    python bench/baseline_sse.py --port 8100 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from sse_starlette.sse import EventSourceResponse

TOKENS = 64


def chunk(response_id: str, model: str, delta: dict, finish: str | None = None) -> str:
    return json.dumps(
        {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
    )


app = FastAPI()


@app.post("/v1/chat/completions")
async def chat(request: Request) -> EventSourceResponse:
    body = await request.json()
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    model = body["model"]
    count = min(int(body.get("max_tokens") or TOKENS), TOKENS)

    async def events() -> AsyncIterator[str]:
        yield chunk(response_id, model, {"role": "assistant", "content": ""})
        for i in range(count):
            yield chunk(
                response_id, model, {"content": f"t{i} "}, "length" if i == count - 1 else None
            )
        yield "[DONE]"

    return EventSourceResponse(events(), ping=15)


def main() -> None:
    global TOKENS
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    TOKENS = args.tokens
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
