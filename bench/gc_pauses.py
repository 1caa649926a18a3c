"""The garbage collector's pauses on the event loop under load, with and without the
freeze ``penstock serve`` does before its engine starts.

Builds the server as ``penstock serve --engine sample -- --delay 0`` does (the engine's
modules imported, then ``freeze_imported_heap`` unless ``--no-freeze``, then the engine,
the app and its lifespan) in this process and streams ``--requests`` chat completions of
64 tokens at concurrency 32 through the app in-process (``bench/asgi_cost.py``'s
harness), timing every collection with ``gc.callbacks``. A full (generation 2) pass walks
every object not frozen, on the loop, stalling every open stream for its duration.

    .venv/bin/python bench/gc_pauses.py            # both, each in a fresh process
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.asgi_cost import _request  # noqa: E402


async def _measure(freeze: bool, requests: int) -> dict[str, Any]:
    from penstock.app.factory import create_app
    from penstock.app.middleware import WireSend
    from penstock.app.server import build_gateway, freeze_imported_heap
    from penstock.engines.loading import load_engine_class
    from penstock.settings import Settings

    settings = Settings(engine="sample", engine_args=["--delay", "0"])
    load_engine_class(settings.engine)
    if freeze:
        freeze_imported_heap()
    gateway = await build_gateway(settings)
    app = create_app(gateway)
    messages = [{"role": "user", "content": "Tell me a story."}]
    body = orjson.dumps(
        {"model": "sample-model", "messages": messages, "max_tokens": 64, "stream": True}
    )
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    began = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - began[0])

    try:
        async with app.router.lifespan_context(app):
            wired = WireSend(app)

            async def worker(count: int) -> None:
                for _ in range(count):
                    await _request(wired, body)

            gc.callbacks.append(timed)
            await asyncio.gather(*(worker(requests // 32) for _ in range(32)))
            gc.callbacks.remove(timed)
    finally:
        await gateway.host.cleanup()
    return {
        "frozen": gc.get_freeze_count(),
        "tracked": len(gc.get_objects()),
        "pauses": {
            str(gen): [len(times), sum(times) * 1e3, max(times, default=0.0) * 1e3]
            for gen, times in pauses.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=9600)
    parser.add_argument("--child", choices=["freeze", "no-freeze"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        result = uvloop.run(_measure(args.child == "freeze", args.requests))
        print(orjson.dumps(result).decode())
        return
    print(f"{args.requests} streamed requests of 64 tokens, concurrency 32, in-process")
    for mode in ("no-freeze", "freeze"):
        argv = [sys.executable, __file__, "--child", mode, "--requests", str(args.requests)]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        result = orjson.loads(done.stdout.strip().splitlines()[-1])
        print(f"\n{mode}: {result['frozen']} objects frozen, {result['tracked']} tracked")
        for gen, (count, total, longest) in result["pauses"].items():
            print(f"  generation {gen}: {count} passes, {total:.1f} ms, longest {longest:.2f} ms")


if __name__ == "__main__":
    main()
