"""The floor with the work: the raw ASGI app of ``raw_asgi.py`` doing the per-request work
any OpenAI gateway must do, with the fastest parts Penstock has, and nothing else.

Per request: the body validated as Penstock's ``ChatCompletionRequest`` (pydantic, from the
JSON bytes), the sample tokenizer's chat template rendered, the prompt tokenized
(Penstock's ``Preprocessor``: pieces and words), ``max_tokens`` ordinary tokens made and
each one detokenized incrementally into its chunk, usage counted. No engine, host,
middleware, metrics, request id or access line:

    python bench/work_floor.py --port 8101 [--delay 0]

Each token costs one event-loop turn, as in ``raw_asgi.py``. What this server costs above
``raw_asgi.py`` is the work itself; what Penstock costs above this server is its own
structure (``bench/streaming_cost.py --floor`` runs all three).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError
from raw_asgi import (
    DEFAULT_TOKENS,
    JSON_HEADERS,
    SSE_HEADERS,
    Pace,
    chunk,
    lifespan,
    read_body,
    serve,
)
from tokenizers import Tokenizer

from penstock.preprocess.preprocessor import Preprocessor
from penstock.schemas.openai import ChatCompletionRequest

TOKENIZER = Path(__file__).resolve().parent.parent / "penstock/engines/assets/sample-tokenizer"
PREPROCESSOR = Preprocessor.from_folder(TOKENIZER)


def _ordinary_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids the sample engine emits: not special, and whole characters on their own."""
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    texts = (tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size()))
    return [i for i, text in enumerate(texts) if i not in special and text and "\ufffd" not in text]


ORDINARY_IDS = _ordinary_ids(Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")))
_next_offset = itertools.count().__next__


async def _send_json(send: Any, status: int, payload: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": orjson.dumps(payload)})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    try:
        request = ChatCompletionRequest.model_validate_json(await read_body(receive))
    except ValidationError as exc:
        error = {"message": str(exc), "type": "BadRequestError", "code": 400}
        await _send_json(send, 400, {"error": error})
        return
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    prompt_ids = PREPROCESSOR.encode(PREPROCESSOR.render_chat(messages))
    detokenizer = PREPROCESSOR.new_detokenizer(prompt_ids)
    count = request.max_tokens or DEFAULT_TOKENS
    offset = _next_offset()
    token_ids = [ORDINARY_IDS[(offset + i) % len(ORDINARY_IDS)] for i in range(count)]
    head = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion.chunk" if request.stream else "chat.completion",
        "created": int(time.time()),
        "model": request.model,
    }
    usage = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": count,
        "total_tokens": len(prompt_ids) + count,
    }
    if not request.stream:
        pieces = []
        for token_id in token_ids:
            await asyncio.sleep(Pace.delay_s)
            pieces.append(detokenizer.step(token_id))
        pieces.append(detokenizer.flush())
        message = {"role": "assistant", "content": "".join(pieces), "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        await _send_json(send, 200, {**head, "choices": [choice], "usage": usage})
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    role = {"role": "assistant", "content": ""}
    first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
    await send({"type": "http.response.body", "body": chunk(head, first), "more_body": True})
    for i, token_id in enumerate(token_ids):
        await asyncio.sleep(Pace.delay_s)
        text = detokenizer.step(token_id)
        finish = None
        if i == count - 1:
            text += detokenizer.flush()
            finish = "length"
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None}
        choice["finish_reason"] = finish
        frame = chunk(head, choice)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    if request.stream_options is not None and request.stream_options.include_usage:
        frame = chunk(head, {}, usage)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


if __name__ == "__main__":
    serve(app, 8101)
