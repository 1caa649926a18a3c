"""A streaming load that costs the client little: raw HTTP/1.1 on keep-alive sockets, the
content chunks counted in the bytes as they arrive, no JSON parsed.

``bench/load.py`` parses every SSE line as JSON through httpx: on a machine with two
cores that client alone caps a zero-delay server near 15k tokens/s and takes CPU the
server would use. This one counts what load.py counts (each event whose delta carries
non-empty content) by searching the bytes for the delta's opening, so it can drive one
ingress core past 20k tokens/s.

    python bench/lean_load.py --url http://127.0.0.1:8000 --concurrency 16 --requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from load import percentile, require_loopback

# A content delta, and an empty one; the role's first delta (``{"role": ...``) is neither.
CONTENT = b'"delta":{"content":"'
EMPTY = b'"delta":{"content":""'
DONE = b"data: [DONE]"
LAST_CHUNK = b"\r\n0\r\n\r\n"
ERROR = b'"error":{'
TAIL = len(EMPTY)


@dataclass
class Outcome:
    tokens: int = 0
    ttft: float | None = None
    error: str | None = None


def request_bytes(host: str, model: str, max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Connection:
    """One keep-alive connection; each :meth:`stream` is one request, read to its end."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self._address = (host, port)
        self._request = request
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def stream(self) -> Outcome:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(*self._address)
        assert self._reader is not None
        outcome = Outcome()
        started = time.perf_counter()
        self._writer.write(self._request)
        tail, done, first = b"", False, True
        while True:
            data = await self._reader.read(1 << 18)
            if not data:
                outcome.error = "connection closed"
                self.close()
                return outcome
            if first:
                first = False
                if not data.startswith(b"HTTP/1.1 200"):
                    outcome.error = data.split(b"\r\n", 1)[0].decode(errors="replace")
                    self.close()
                    return outcome
            # A pattern split across two reads is found in the previous read's tail.
            window = tail + data
            found = window.count(CONTENT) - window.count(EMPTY)
            if found and outcome.ttft is None:
                outcome.ttft = time.perf_counter() - started
            outcome.tokens += found
            if ERROR in window:
                outcome.error = "stream error"
            done = done or DONE in window
            if done and window.endswith(LAST_CHUNK):
                return outcome
            tail = window[-TAIL:]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def run(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """load.py's figures (tokens/s, TTFT, errors) for ``requests`` streams at
    ``concurrency``, after one warm-up stream per connection."""
    require_loopback(url)
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    request = request_bytes(host, model, max_tokens)
    connections = [Connection(host, port, request) for _ in range(concurrency)]
    await asyncio.gather(*(connection.stream() for connection in connections))
    outcomes: list[Outcome] = []
    left = [requests]

    async def worker(connection: Connection) -> None:
        while left[0] > 0:
            left[0] -= 1
            outcomes.append(await connection.stream())

    started = time.perf_counter()
    await asyncio.gather(*(worker(connection) for connection in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    return {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "tokens_per_s": sum(o.tokens for o in ok) / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        "mean_tokens": statistics.fmean(o.tokens for o in ok) if ok else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="sample-model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    figures = run(args.url, args.model, args.concurrency, args.requests, args.max_tokens)
    print(json.dumps(asyncio.run(figures)))


if __name__ == "__main__":
    main()
