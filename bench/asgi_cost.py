"""Penstock's own CPU per request and per token, without sockets or a client.

Builds the server's ASGI app around the sample engine (``--delay 0``) in this process and
calls it with ASGI messages: what is left is Penstock's Python (middlewares, parsing,
preprocessing, the engine host, detokenizing, chunk encoding), none of the HTTP parsing,
socket writes or load generator that ``streaming_cost.py`` measures along with it. CPU
time of the process, median of ``--rounds``; with ``--before`` the rounds alternate with
a second tree, run from its own folder.

With ``--floor`` the same requests also go to ``work_floor.py``'s app (the work every
request needs, nothing else); with ``--calls`` each figure is the number of Python
function calls per request (``cProfile``'s count, C functions included) instead of CPU
time: no noise, and the same in every run.

    .venv/bin/python bench/asgi_cost.py
    .venv/bin/python bench/asgi_cost.py --before /tmp/penstock-before --rounds 5
    .venv/bin/python bench/asgi_cost.py --floor --calls
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
# (name, streamed, concurrency, requests, tokens per request)
SCENARIOS = [
    ("stream 32 x 512", True, 32, 320, 512),
    ("stream 256 x 64", True, 256, 2048, 64),
    ("non-streaming 16 tokens", False, 1, 3000, 16),
]


def _scope(body: bytes) -> dict[str, Any]:
    path = "/v1/chat/completions"
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"penstock"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }


async def _request(app: Any, body: bytes) -> None:
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"HTTP {message['status']}")

    await app(_scope(body), receive, send)


@contextlib.asynccontextmanager
async def _penstock_app() -> AsyncIterator[Any]:
    from penstock.app.factory import create_app
    from penstock.app.middleware import WireSend
    from penstock.app.server import build_gateway, freeze_imported_heap
    from penstock.engines.loading import load_engine_class
    from penstock.settings import Settings

    settings = Settings(engine="sample", engine_args=["--delay", "0", "--max-tokens", "16"])
    # As `penstock serve` does: no garbage-collector pass walks the imported modules.
    load_engine_class(settings.engine)
    freeze_imported_heap()
    gateway = await build_gateway(settings)
    app = create_app(gateway)
    try:
        async with app.router.lifespan_context(app):
            yield WireSend(app)
    finally:
        await gateway.host.cleanup()


@contextlib.asynccontextmanager
async def _floor_app() -> AsyncIterator[Any]:
    import work_floor

    from penstock.app.server import freeze_imported_heap

    freeze_imported_heap()
    yield work_floor.app


async def _measure(
    floor: bool, calls: bool, streamed: bool, concurrency: int, requests: int, tokens: int
) -> float:
    """CPU microseconds (or with ``calls``, Python function calls) per request of one
    scenario, served by Penstock or (``floor``) by ``work_floor.py``'s app."""
    # A new number in each user message: no tokenizer cache serves a whole prompt.
    bodies = [
        orjson.dumps(
            {
                "model": "sample-model",
                "messages": [{"role": "user", "content": f"Tell me story number {number}."}],
                "max_tokens": tokens,
                "stream": streamed,
            }
        )
        for number in range(requests + 50)
    ]
    next_body = iter(bodies).__next__
    async with _floor_app() if floor else _penstock_app() as app:
        for _ in range(50):
            await _request(app, next_body())

        async def worker(count: int) -> None:
            for _ in range(count):
                await _request(app, next_body())

        done = requests // concurrency * concurrency
        if calls:
            profile = cProfile.Profile()
            profile.enable()
            await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
            profile.disable()
            return pstats.Stats(profile).total_calls / done
        started = time.process_time()
        await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
        return (time.process_time() - started) / done * 1e6


def _child(floor: bool, calls: bool, index: int) -> None:
    import uvloop

    from penstock.app.logs import configure_logging

    # Log lines (the access line of every request) are written as `penstock serve` writes
    # them, to a discarded stream in place of standard error.
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
    configure_logging("info", "text")
    sys.stderr = stderr
    _, streamed, concurrency, requests, tokens = SCENARIOS[index]
    if calls:
        requests = min(requests, 8 * concurrency)
    print(uvloop.run(_measure(floor, calls, streamed, concurrency, requests, tokens)))


def _run(tree: Path, index: int, floor: bool, calls: bool) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, str(HERE / "asgi_cost.py"), "--scenario", str(index)]
    argv += ["--floor"] * floor + ["--calls"] * calls
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE.parent, help="the Penstock to run")
    parser.add_argument("--before", type=Path, default=None, help="a second tree, run beside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="also run work_floor.py's app")
    parser.add_argument("--calls", action="store_true", help="count Python calls, not CPU")
    parser.add_argument("--scenario", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario is not None:
        _child(args.floor, args.calls, args.scenario)
        return
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  load avg {load}")
    # (label, tree, floor)
    runs = [("now", args.repo, False)]
    runs += [("before", args.before, False)] if args.before else []
    runs += [("floor", args.repo, True)] if args.floor else []
    rounds = 1 if args.calls else args.rounds
    unit = "Python calls" if args.calls else "CPU us"
    for index, (name, _, _, _, tokens) in enumerate(SCENARIOS):
        results: dict[str, list[float]] = {label: [] for label, _, _ in runs}
        for _ in range(rounds):
            for label, tree, floor in runs:
                results[label].append(_run(tree, index, floor, args.calls))
        print(f"\n{name}: {unit} per request (per token)")
        for label, values in results.items():
            median = statistics.median(values)
            rounds_text = ", ".join(f"{value:.1f}" for value in values)
            print(f"  {label:7s} {median:8.1f} ({median / tokens:.2f})  rounds {rounds_text}")


if __name__ == "__main__":
    main()
