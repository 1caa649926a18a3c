"""The Ray data plane alone, without Ray or the gateway: µs of CPU per token at each end.

A replica process serves ``penstock.ray.batching.StreamServer`` with a stand-in engine
(one loop turn per token, the sample engine's chunk shape) on a plain asyncio loop, as a
Serve replica runs its user code; the ingress process (on uvloop, as ``penstock serve``)
opens ``--concurrency`` streams at a time over one ``penstock.ray.streams.ReplicaChannel``
and takes each chunk as the fleet host does. The replica runs on CPU 1 and the ingress on
CPU 0. With ``--before TREE`` the same runs alternate with that checkout's data plane.

    python bench/data_plane.py [--concurrency 16] [--streams 20] [--repeats 3] [--before TREE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"


class _LoopTurn:
    """One turn of the event loop, as the sample engine's ``--delay 0`` gives per token."""

    def __await__(self) -> Generator[None, None, None]:
        yield


def source(tokens: int) -> Any:
    async def chunks(
        request_id: str, request: dict[str, Any], adapter: Any
    ) -> AsyncIterator[dict[str, Any]]:
        engine_data = {"weight_version": None}
        for step in range(tokens):
            await _LoopTurn()
            chunk = {"token_ids": [33 + step % 90], "index": 0, "engine_data": engine_data}
            if step == tokens - 1:
                chunk["finish_reason"] = "length"
            yield chunk

    return chunks


async def replica(tokens: int) -> None:
    from penstock.ray.batching import StreamServer

    server = StreamServer(source(tokens), TOKEN, "bench replica")
    print(await server.start("127.0.0.1"), flush=True)
    await asyncio.Event().wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ingress(address: str, replica_pid: int, args: argparse.Namespace) -> dict[str, float]:
    from penstock.ray.streams import ReplicaChannel
    from penstock.ray.wire import entry_error

    channel = ReplicaChannel("replica", address, TOKEN)
    await channel.connect()
    received = [0]

    async def chunks(request_id: str) -> AsyncIterator[dict[str, Any]]:
        async for batch in channel.open(request_id, {}, None).batches():
            for chunk in batch:
                if (error := entry_error(chunk)) is not None:
                    raise error
                yield chunk

    async def client(index: int, streams: int) -> None:
        for number in range(streams):
            async for chunk in chunks(f"r{index}-{number}"):
                received[0] += len(chunk["token_ids"])

    await asyncio.gather(*(client(i, 2) for i in range(2)))
    received[0] = 0
    started, own, other = time.perf_counter(), time.process_time(), cpu_seconds(replica_pid)
    await asyncio.gather(*(client(i, args.streams) for i in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    own, other = time.process_time() - own, cpu_seconds(replica_pid) - other
    channel.close()
    tokens = received[0]
    return {
        "tokens_per_s": tokens / elapsed,
        "ingress_us_per_token": 1e6 * own / tokens,
        "replica_us_per_token": 1e6 * other / tokens,
    }


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One measurement of ``tree``'s data plane, each end in a process of its own."""
    argv = [sys.executable, __file__, "--tokens", str(args.tokens)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    serving = subprocess.Popen(
        [*argv, "--end", "replica"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert serving.stdout is not None
        ingress_argv = [*argv, "--end", "ingress", "--address", serving.stdout.readline().strip()]
        ingress_argv += ["--replica-pid", str(serving.pid), "--concurrency", str(args.concurrency)]
        ingress_argv += ["--streams", str(args.streams)]
        out = subprocess.run(ingress_argv, env=env, capture_output=True, text=True, check=True)
        return dict(json.loads(out.stdout))
    finally:
        serving.terminate()
        serving.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--streams", type=int, default=20, help="per concurrent client")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--end", choices=["replica", "ingress"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--replica-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.end == "replica":
        os.sched_setaffinity(0, {1})
        asyncio.run(replica(args.tokens))
        return
    if args.end == "ingress":
        import uvloop

        os.sched_setaffinity(0, {0})
        figures = uvloop.run(ingress(args.address, args.replica_pid, args))
        print(json.dumps(figures))
        return
    trees = {"this tree": REPO, **({"before": args.before.resolve()} if args.before else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args))
            print(json.dumps({"tree": name, **runs[name][-1]}), flush=True)
    for name, rows in runs.items():
        medians = {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]}
        print(json.dumps({"tree": name, "median_of": len(rows), **medians}), flush=True)


if __name__ == "__main__":
    main()
