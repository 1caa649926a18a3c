"""Penstock's CPU per request and per chunk with its HTTP protocol, without sockets.

``asgi_cost.py`` calls the app with ASGI messages; this feeds whole HTTP/1.1 requests as
bytes to the server's own protocol (``GuardedHttpProtocol`` over uvicorn's httptools one,
with ``WireSend`` and the connection's ``ChunkedFrameWriter``, as ``penstock serve`` runs
them) on keep-alive connections whose transports only count what is written. What is left
out is the socket I/O and the client. It runs one scenario in this process:

* ``cpu``: CPU microseconds per request and per chunk, ``--rounds`` rounds;
* ``calls``: Python function calls per request (``cProfile``'s count);
* ``gc``: the garbage collector's passes over the rounds, by generation, with their time
  per request (``gc.callbacks``), and the objects one more round leaves to the collector
  (reference cycles: ``gc.DEBUG_SAVEALL``), by type;
* ``run``: the rounds and nothing else, for an instruction counter. Run it under valgrind
  for two round counts and divide the difference by the requests between them::

      PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 valgrind --tool=cachegrind --cache-sim=no \\
          .venv/bin/python bench/protocol_cost.py run --scenario unary --rounds 10 --no-passes

  ``--no-passes`` stops the sample engine's simulated forward passes, which come once per
  10 ms of wall time (and valgrind stretches the wall time); one OpenBLAS thread keeps
  numpy's idle worker threads out of the count.

Scenarios: ``stream32`` (32 connections x 512 tokens), ``stream256`` (256 x 64),
``ttft`` (one connection, streamed, 16 tokens), ``unary`` (one connection, not
streamed, 16 tokens) and ``unary32`` (32 connections, not streamed, 16 tokens). Run
it from the tree to measure, with ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib
import os
import pstats
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

# name: (streamed, connections, tokens per request)
SCENARIOS = {
    "stream32": (True, 32, 512),
    "stream256": (True, 256, 64),
    "ttft": (True, 1, 16),
    "unary": (False, 1, 16),
    "unary32": (False, 32, 16),
}


class CountingTransport(asyncio.Transport):
    """A connection's transport that counts the bytes written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False
        self.written = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name)

    def write(self, data: Any) -> None:
        self.written += len(data)

    def writelines(self, data: Any) -> None:
        self.written += sum(len(piece) for piece in data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0


def request_bytes(number: int, stream: bool, tokens: int) -> bytes:
    """One chat request as a client sends it; a new number each, so no tokenizer cache
    serves a whole prompt."""
    body = orjson.dumps(
        {
            "model": "sample-model",
            "messages": [{"role": "user", "content": f"Tell me story number {number}."}],
            "max_tokens": tokens,
            "stream": stream,
        }
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"
        b"content-type: application/json\r\naccept: */*\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    return head + body


def stop_forward_passes() -> None:
    """No simulated forward pass while the rounds run (the constant moved between trees)."""
    for name in ("penstock.engines.samples.telemetry", "penstock.engines.samples.engine"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "MIN_PASS_INTERVAL_S"):
            module.MIN_PASS_INTERVAL_S = 1e9


class CollectorPasses:
    """A ``gc.callbacks`` entry: the collector's passes and their seconds, by generation."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = info["generation"]
        self.passes[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._began

    def report(self, requests: int) -> str:
        return "; ".join(
            f"generation {g}: {self.passes[g]} passes, {self.seconds[g] / requests * 1e6:.2f} us"
            " a request"
            for g in range(3)
        )


async def left_to_collector(one_round: Callable[[], Awaitable[None]], requests: int) -> str:
    """What one more round leaves that only the collector frees (reference cycles)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await one_round()
        gc.collect()
        kinds = Counter(type(item).__qualname__ for item in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    listed = ", ".join(f"{name} {count / requests:g}" for name, count in kinds.most_common(8))
    total = sum(kinds.values()) / requests
    return f"{total:g} objects a request left to the collector" + (f": {listed}" if listed else "")


async def measure(mode: str, scenario: str, rounds: int) -> str:
    import uvicorn
    from uvicorn.server import ServerState

    from penstock.app.connections import ConnectionLimits, guarded_protocol
    from penstock.app.factory import create_app
    from penstock.app.middleware import WireSend
    from penstock.app.server import build_gateway, freeze_imported_heap
    from penstock.engines.loading import load_engine_class
    from penstock.settings import Settings

    stream, connections, tokens = SCENARIOS[scenario]
    settings = Settings(engine="sample", engine_args=["--delay", "0", "--max-tokens", "16"])
    # As `penstock serve` does: no garbage-collector pass walks the imported modules.
    load_engine_class(settings.engine)
    freeze_imported_heap()
    gateway = await build_gateway(settings)
    app = create_app(gateway)
    config = uvicorn.Config(
        WireSend(app),
        http=guarded_protocol(ConnectionLimits(10.0, 30.0, 2048)),
        ws="none",
        log_config=None,
        access_log=False,
        timeout_keep_alive=60,
    )
    config.load()
    state = ServerState()
    sent = 0
    try:
        async with app.router.lifespan_context(app):
            protocols: list[Any] = []
            for _ in range(connections):
                protocol: Any = config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=state, app_state={}
                )
                protocol.connection_made(CountingTransport())
                protocols.append(protocol)

            async def one_round() -> None:
                nonlocal sent
                for protocol in protocols:
                    sent += 1
                    protocol.data_received(request_bytes(sent, stream, tokens))
                while state.tasks:
                    await asyncio.gather(*state.tasks)

            for _ in range(max(2, 64 // connections)):
                await one_round()
            requests = rounds * connections
            profile = cProfile.Profile() if mode == "calls" else None
            passes = CollectorPasses() if mode == "gc" else None
            if passes is not None:
                gc.callbacks.append(passes)
            started = time.process_time()
            if profile is not None:
                profile.enable()
            for _ in range(rounds):
                await one_round()
            if profile is not None:
                profile.disable()
            elapsed = time.process_time() - started
            if passes is not None:
                gc.callbacks.remove(passes)
                leftover = await left_to_collector(one_round, connections)
            for protocol in protocols:
                protocol.connection_lost(None)
    finally:
        await gateway.host.cleanup()
    if profile is not None:
        return f"{pstats.Stats(profile).total_calls / requests:.1f} Python calls a request"
    if passes is not None:
        return f"{passes.report(requests)}\n{leftover}"
    per_request = elapsed / requests * 1e6
    return f"{per_request:.1f} CPU us a request, {per_request / tokens:.2f} a chunk"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["cpu", "calls", "gc", "run"])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="unary")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--no-passes", action="store_true", help="no simulated forward passes")
    args = parser.parse_args()
    import uvloop

    from penstock.app.logs import configure_logging

    # Log lines (the access line of every request) are written as `penstock serve` writes
    # them, to a discarded stream in place of standard error.
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
    configure_logging("info", "text")
    sys.stderr = stderr
    if args.no_passes:
        stop_forward_passes()
    result = uvloop.run(measure(args.mode, args.scenario, args.rounds))
    if args.mode != "run":
        print(result)


if __name__ == "__main__":
    main()
