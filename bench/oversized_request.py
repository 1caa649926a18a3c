"""What one oversized request costs everyone else, and the server's memory.

Starts ``penstock serve --engine sample`` (loopback, a free port), then measures for
``--seconds``: ``/live`` latency (polled every 10 ms) and the inter-token latency of
``--streams`` concurrent streams, first idle, then with one oversized request always in
flight (sent from another process again as soon as it is answered, or ``--pause`` seconds
later). Last, the server's peak RSS (VmHWM) before and after one body of
``--max-body-mb`` minus a little (the largest accepted).

    python bench/oversized_request.py --prompt-mb 8
    python bench/oversized_request.py --prompt-mb 8 --serve-arg=--max-chars-per-token=1e6

The second form loosens the length bound so the 8 MB prompt is really tokenized, as a
long-context model with long tokens would allow. ``--repo`` runs another checkout's code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

MODEL = "sample-model"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def chat_body(text: str) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return json.dumps(body).encode()


async def stream_gaps(client: httpx.AsyncClient, until: float, gaps: list[float]) -> None:
    """Stream long completions back to back until ``until``, recording token gaps."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}
    while time.perf_counter() < until:
        last: float | None = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if now >= until:
                    break


async def poll_live(client: httpx.AsyncClient, until: float, latencies: list[float]) -> None:
    while time.perf_counter() < until:
        started = time.perf_counter()
        await client.get("/live")
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)


def keep_one_in_flight(url: str, body: bytes, seconds: float, pause: float) -> list[int]:
    """Send ``body`` again and again; a process of its own, so encoding and sending
    megabytes doesn't stall the measuring client."""
    statuses: list[int] = []
    headers = {"content-type": "application/json"}
    until = time.perf_counter() + seconds
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.perf_counter() < until:
            response = client.post("/v1/chat/completions", content=body, headers=headers)
            statuses.append(response.status_code)
            time.sleep(pause)
    return statuses


async def window(
    url: str, seconds: float, streams: int, oversized: bytes | None, pause: float = 0.0
) -> dict[str, float | int | list[int]]:
    gaps: list[float] = []
    live: list[float] = []
    statuses: list[int] = []
    with ProcessPoolExecutor(1) as sender:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            until = time.perf_counter() + seconds
            work = [stream_gaps(client, until, gaps) for _ in range(streams)]
            work.append(poll_live(client, until, live))
            sent = None
            if oversized is not None:
                loop = asyncio.get_running_loop()
                sent = loop.run_in_executor(
                    sender, keep_one_in_flight, url, oversized, seconds, pause
                )
            await asyncio.gather(*work)
            if sent is not None:
                statuses = await sent
    return {
        "live_p50_ms": round(1000 * percentile(live, 0.5), 2),
        "live_p99_ms": round(1000 * percentile(live, 0.99), 2),
        "live_max_ms": round(1000 * max(live, default=float("nan")), 2),
        "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2),
        "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
        "itl_max_ms": round(1000 * max(gaps, default=float("nan")), 2),
        "oversized_answers": sorted(set(statuses)),
        "oversized_sent": len(statuses),
    }


@contextlib.contextmanager
def server(repo: Path, serve_args: list[str], delay: float) -> Iterator[tuple[int, str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "penstock", "serve", "--engine", "sample"]
    command += ["--port", str(port), "--log-level", "warning", *serve_args]
    command += ["--", "--delay", str(delay)]
    process = subprocess.Popen(command, env=env, cwd=repo, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/live", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield process.pid, url
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--prompt-mb", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.01, help="sample engine s/token")
    parser.add_argument("--max-body-mb", type=float, default=45.0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between oversized requests"
    )
    parser.add_argument("--skip-rss", action="store_true")
    args = parser.parse_args()
    oversized = chat_body("many words " * int(args.prompt_mb * 1024 * 1024 / 11))
    report: dict[str, object] = {"prompt_bytes": len(oversized)}
    with server(args.repo, args.serve_arg, args.delay) as (pid, url):
        report["idle"] = asyncio.run(window(url, args.seconds, args.streams, None))
        report["oversized"] = asyncio.run(
            window(url, args.seconds, args.streams, oversized, args.pause)
        )
    if not args.skip_rss:
        serve_args = [*args.serve_arg, "--max-body-mb", str(args.max_body_mb)]
        with server(args.repo, serve_args, args.delay) as (pid, url):
            largest = chat_body("many words " * int((args.max_body_mb - 0.5) * 1024 * 1024 / 11))
            before = peak_rss_mb(pid)
            started = time.perf_counter()
            response = httpx.post(
                f"{url}/v1/chat/completions",
                content=largest,
                headers={"content-type": "application/json"},
                timeout=600,
            )
            report["largest_body"] = {
                "bytes": len(largest),
                "status": response.status_code,
                "seconds": round(time.perf_counter() - started, 2),
                "peak_rss_mb_before": round(before),
                "peak_rss_mb_after": round(peak_rss_mb(pid)),
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
