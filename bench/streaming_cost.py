"""Penstock vs the raw ASGI floor (``bench/raw_asgi.py``), side by side in one invocation.

Starts both servers on loopback and reports, for each, alternating between them:

* server CPU per streamed chunk (each thread's time on a CPU, from
  ``/proc/<pid>/task/*/schedstat`` around the run, divided by the tokens streamed) at
  32 streams x 512 tokens and 256 streams x 64 tokens: robust where the cores are shared,
  unlike req/s;
* TTFT p50 at concurrency 1 over one keep-alive connection (request sent to the first
  token's frame), and the server's CPU per request meanwhile;
* non-streaming req/s at concurrency 32 (and the server's CPU per request);
* RSS per 1,000 open streams at 1,000 and 5,000 open streams (fresh servers whose tokens
  come a few seconds apart, so every stream stays open), and Penstock's idle RSS.

With ``--floor``, ``bench/work_floor.py`` runs beside them: the raw app doing the work every
request needs (validation, chat template, tokenizing, detokenizing), which splits
Penstock's cost above the raw app into that work and the rest.

Penstock runs as ``penstock serve --engine sample -- --delay 0`` with its defaults: the
real tokenizer, incremental detokenizer, stop matching, usage, metrics and access log (to
a file). The client is aiohttp, one session per scenario, keep-alive connections.

    .venv/bin/python bench/streaming_cost.py --repeats 3
    .venv/bin/python bench/streaming_cost.py --only cpu --before /tmp/penstock-before
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
PAGE = os.sysconf("SC_PAGE_SIZE")
MODEL = "sample-model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """The server's CPU time: in nanoseconds from each live thread's ``schedstat``.

    ``/proc/<pid>/stat`` counts in clock ticks (10 ms), a step of 0.3 µs a chunk at
    32 x 512, coarser than the differences between trees; a thread that ended since the
    last reading would be missed, and the servers keep their threads while measured.
    """
    tasks = Path(f"/proc/{pid}/task")
    total = 0
    for task in tasks.iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


def start(
    name: str, argv: list[str], env: dict[str, str], log: Path, pin: str | None, cwd: Path
) -> Server:
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    if pin is not None:
        argv = ["taskset", "-c", pin, *argv]
    with log.open("wb") as out:
        # ``python -m`` puts the working directory first on the path, before PYTHONPATH.
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    server = Server(name, process, port)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return server
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"{name} not ready in 120 s")


def stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@contextlib.contextmanager
def servers(args: argparse.Namespace, *, delay: float, extra: list[str]) -> Iterator[list[Server]]:
    """The raw app, the work floor with ``--floor``, then Penstock (``--repo``), then the
    ``--before`` tree if given."""
    logs = Path(tempfile.mkdtemp(prefix="penstock-bench-"))
    pace = ["--port", "{port}", "--delay", str(delay), "--loop", args.raw_loop]
    raw_argv = [sys.executable, str(HERE / "raw_asgi.py"), *pace]
    floor_argv = [sys.executable, str(HERE / "work_floor.py"), *pace]
    penstock_argv = [sys.executable, "-m", "penstock", "serve", "--port", "{port}", *extra]
    penstock_argv += ["--engine", "sample", "--", "--delay", str(delay), "--max-tokens", "16"]
    trees = [("penstock", args.repo)] + ([("before", args.before)] if args.before else [])
    started: list[Server] = []
    try:
        env = {**os.environ, "PYTHONPATH": str(args.repo)}
        started.append(start("raw", raw_argv, env, logs / "raw.log", args.pin, args.repo))
        if args.floor:
            log = logs / "floor.log"
            started.append(start("floor", floor_argv, env, log, args.pin, args.repo))
        for name, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            log = logs / f"{name}.log"
            started.append(start(name, penstock_argv, env, log, args.pin, tree))
        yield started
    finally:
        for server in started:
            stop(server)


def chat_bodies(max_tokens: int, stream: bool) -> Callable[[], bytes]:
    """Request bodies whose user message carries a new number each time: the template's
    system prompt and role headers recur, as in real traffic, but no tokenizer cache can
    serve a whole prompt."""
    numbers = itertools.count()

    def body() -> bytes:
        messages = [{"role": "user", "content": f"Tell me story number {next(numbers)}."}]
        return orjson.dumps(
            {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
        )

    return body


HEADERS = {"content-type": "application/json"}


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """Stream one response; returns the number of data frames before ``[DONE]``."""
    async with session.post(url, data=body, headers=HEADERS) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        frames = 0
        async for data in response.content.iter_any():
            frames += data.count(b"data: ")
        return frames - 1


def session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def cpu_per_chunk(server: Server, concurrency: int, tokens: int, rounds: int) -> float:
    url = server.url + "/v1/chat/completions"
    body = chat_bodies(tokens, True)
    async with session(concurrency) as client:
        await asyncio.gather(*(stream_once(client, url, body()) for _ in range(concurrency)))

        async def worker() -> int:
            return sum([await stream_once(client, url, body()) for _ in range(rounds)])

        before = cpu_seconds(server.pid)
        frames = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        used = cpu_seconds(server.pid) - before
    expected = concurrency * rounds * (tokens + 1)
    if frames != expected:
        raise RuntimeError(f"{server.name}: {frames} frames, expected {expected}")
    return used / (concurrency * rounds * tokens) * 1e6


async def ttft_p50(server: Server, requests: int) -> tuple[float, float]:
    """TTFT p50 in ms at concurrency 1, and the server's CPU µs a request meanwhile."""
    url = server.url + "/v1/chat/completions"
    body = chat_bodies(8, True)
    async with session(1) as client:

        async def first_frame() -> float:
            started = time.perf_counter()
            first = 0.0
            async with client.post(url, data=body(), headers=HEADERS) as response:
                seen = 0
                async for data in response.content.iter_any():
                    seen += data.count(b"data: ")
                    if not first and seen >= 2:
                        first = time.perf_counter() - started
            return first

        for _ in range(10):
            await first_frame()
        before_cpu = cpu_seconds(server.pid)
        samples = [await first_frame() for _ in range(requests)]
        used = cpu_seconds(server.pid) - before_cpu
    return statistics.median(samples) * 1e3, used / requests * 1e6


async def non_streaming(server: Server, concurrency: int, rounds: int) -> tuple[float, float]:
    url = server.url + "/v1/chat/completions"
    body = chat_bodies(16, False)

    async def worker(client: aiohttp.ClientSession, count: int) -> None:
        for _ in range(count):
            async with client.post(url, data=body(), headers=HEADERS) as response:
                payload = await response.read()
                if response.status != 200 or b'"choices"' not in payload:
                    raise RuntimeError(f"{server.name}: HTTP {response.status}")

    async with session(concurrency) as client:
        await asyncio.gather(*(worker(client, 2) for _ in range(concurrency)))
        before_cpu, started = cpu_seconds(server.pid), time.perf_counter()
        await asyncio.gather(*(worker(client, rounds) for _ in range(concurrency)))
        wall = time.perf_counter() - started
        used = cpu_seconds(server.pid) - before_cpu
    total = concurrency * rounds
    return total / wall, used / total * 1e6


async def open_streams(server: Server, counts: list[int]) -> dict[int, float]:
    """RSS growth (MB per 1,000 streams) with each count of streams open at once."""
    url = server.url + "/v1/chat/completions"
    body = chat_bodies(1000, True)
    async with session(max(counts) + 10) as client:
        await stream_once(client, url, chat_bodies(4, True)())
        await asyncio.sleep(1)
        idle = rss_mb(server.pid)
        responses: list[aiohttp.ClientResponse] = []

        async def open_one() -> None:
            response = await client.post(url, data=body(), headers=HEADERS)
            if response.status != 200:
                raise RuntimeError(f"{server.name}: HTTP {response.status}")
            # The first token's frame: the whole request state exists on the server.
            seen = 0
            while seen < 2:
                seen += (await response.content.readany()).count(b"data: ")
            responses.append(response)

        growth = {}
        for count in counts:
            while len(responses) < count:
                batch = min(1000, count - len(responses))
                await asyncio.gather(*(open_one() for _ in range(batch)))
            await asyncio.sleep(2)
            growth[count] = (rss_mb(server.pid) - idle) / count * 1000
        for response in responses:
            response.close()
    return growth


def fmt(values: list[float], digits: int = 1) -> str:
    return (
        ", ".join(f"{v:.{digits}f}" for v in values)
        + f" (median {statistics.median(values):.{digits}f})"
    )


def ratio_to_raw(results: dict[str, list[float]], name: str) -> str:
    if name == "raw":
        return ""
    return f"  ({statistics.median(results[name]) / statistics.median(results['raw']):.2f}x raw)"


def in_turn(started: list[Server], repeat: int) -> list[Server]:
    """The servers in the order to measure them in this repeat: forward, then backward,
    as whichever is measured first in a round came out slower on this machine."""
    return started if repeat % 2 == 0 else started[::-1]


async def run_cpu(args: argparse.Namespace) -> None:
    with servers(args, delay=0.0, extra=args.serve_arg) as started:
        print(
            "idle RSS at start, MB: " + ", ".join(f"{s.name} {rss_mb(s.pid):.1f}" for s in started)
        )
        scenarios = [(32, 512, args.rounds), (256, 64, args.rounds)]
        if not {"all", "cpu"} & set(args.only):
            scenarios = []
        for concurrency, tokens, rounds in scenarios:
            results: dict[str, list[float]] = {s.name: [] for s in started}
            loads = []
            for repeat in range(args.repeats):
                loads.append(loadavg())
                for server in in_turn(started, repeat):
                    results[server.name].append(
                        await cpu_per_chunk(server, concurrency, tokens, rounds)
                    )
            print(f"\nCPU us/chunk, {concurrency} streams x {tokens} tokens (load avg {loads}):")
            for name, values in results.items():
                print(f"  {name:9s} {fmt(values)}{ratio_to_raw(results, name)}")
        if {"all", "ttft"} & set(args.only):
            ttft: dict[str, list[float]] = {s.name: [] for s in started}
            ttft_cpu: dict[str, list[float]] = {s.name: [] for s in started}
            for repeat in range(args.repeats):
                for server in in_turn(started, repeat):
                    latency, cost = await ttft_p50(server, args.ttft_requests)
                    ttft[server.name].append(latency)
                    ttft_cpu[server.name].append(cost)
            print(f"\nTTFT p50 ms, concurrency 1, keep-alive (load avg {loadavg()}):")
            for name, values in ttft.items():
                print(
                    f"  {name:9s} {fmt(values, 3)}{ratio_to_raw(ttft, name)}; "
                    f"CPU us/request {fmt(ttft_cpu[name], 0)}"
                )
            rates: dict[str, list[float]] = {s.name: [] for s in started}
            costs: dict[str, list[float]] = {s.name: [] for s in started}
            for repeat in range(args.repeats):
                for server in in_turn(started, repeat):
                    rate, cost = await non_streaming(server, 32, args.unary_rounds)
                    rates[server.name].append(rate)
                    costs[server.name].append(cost)
            print(f"\nnon-streaming, concurrency 32, 16 tokens (load avg {loadavg()}):")
            for name in rates:
                raw_over = statistics.median(rates["raw"]) / statistics.median(rates[name])
                print(
                    f"  {name:9s} req/s {fmt(rates[name], 0)} (raw/this {raw_over:.2f}x); "
                    f"CPU us/request {fmt(costs[name], 0)}{ratio_to_raw(costs, name)}"
                )


async def run_memory(args: argparse.Namespace) -> None:
    extra = [*args.serve_arg, "--max-concurrency", "8192", "--max-queue", "8192"]
    extra += ["--max-connections", "8192", "--no-access-log"]
    counts = [1000, 5000]
    with servers(args, delay=args.hold_delay, extra=extra) as started:
        print(f"\nRSS MB per 1,000 open streams (load avg {loadavg()}):")
        for server in started:
            growth = await open_streams(server, counts)
            cells = ", ".join(f"{n} open: {mb:.1f}" for n, mb in growth.items())
            print(f"  {server.name:9s} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE.parent, help="the Penstock to run")
    parser.add_argument("--before", type=Path, default=None, help="a second tree, run beside")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream slot")
    parser.add_argument("--ttft-requests", type=int, default=200)
    parser.add_argument("--unary-rounds", type=int, default=30)
    parser.add_argument("--hold-delay", type=float, default=5.0)
    parser.add_argument("--raw-loop", default="auto", help="uvicorn --loop of the raw app")
    parser.add_argument("--pin", default=None, help="taskset CPU list for the servers")
    parser.add_argument(
        "--floor", action="store_true", help="also run work_floor.py: the raw app doing the work"
    )
    parser.add_argument("--only", nargs="+", default=["all"], choices=["all", "cpu", "ttft", "rss"])
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  repo {args.repo}  load avg {loadavg()}")
    if {"all", "cpu", "ttft"} & set(args.only):
        asyncio.run(run_cpu(args))
    if {"all", "rss"} & set(args.only):
        asyncio.run(run_memory(args))


if __name__ == "__main__":
    main()
