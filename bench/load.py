"""Streaming load generator for any OpenAI-compatible server (loopback only).

Measures requests/s, streamed tokens/s (content chunks), TTFT p50/p99, inter-token
latency p50/p99 and errors at a fixed concurrency.

    python bench/load.py --url http://127.0.0.1:8000 --model sample-model \\
        --concurrency 32 --requests 640 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import socket
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    address = ipaddress.ip_address(socket.gethostbyname(host))
    if not address.is_loopback:
        raise SystemExit(f"refusing to load a non-loopback host: {host}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace) -> Result:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    result = Result()
    started = time.perf_counter()
    last = started
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("delta", {}).get("content"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    result.gaps.append(now - last)
                last = now
                result.tokens += 1
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    return result


async def run(args: argparse.Namespace) -> dict[str, float | int]:
    require_loopback(args.url)
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(base_url=args.url, timeout=120, limits=limits) as client:
        for _ in range(min(args.concurrency, 8)):
            await one_request(client, args)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(i)
        results: list[Result] = []

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, args))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    return {
        "concurrency": args.concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "req_per_s": len(ok) / elapsed,
        "tokens_per_s": sum(r.tokens for r in ok) / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        "itl_p50_ms": 1000 * percentile(gaps, 0.5),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "mean_tokens": statistics.fmean(r.tokens for r in ok) if ok else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="sample-model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=0, help="default: 20 x concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    args.requests = args.requests or 20 * args.concurrency
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
