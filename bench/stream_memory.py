"""Where the memory of an open stream goes: tracemalloc over N open chat streams.

Server (``penstock serve --engine sample``, tokens 5 s apart so every stream stays open)
and an aiohttp client run in one process on asyncio's loop; the client's own allocations
are filtered out. Prints the traced bytes per stream and the lines that allocated most:

    .venv/bin/python bench/stream_memory.py --streams 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import linecache
import sys
import tracemalloc
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.streaming_cost import HEADERS, chat_bodies, free_port, session, stream_once
from penstock.app.server import serve
from penstock.settings import Settings

CLIENT_SIDE = ("*aiohttp*", "*yarl*", "*multidict*", "*tracemalloc*", "*/bench/*")


async def open_streams(streams: int, top: int) -> None:
    port = free_port()
    settings = Settings(
        engine="sample",
        port=port,
        engine_args=["--delay", "5", "--max-tokens", "16"],
        max_concurrency=8192,
        max_queue=8192,
        max_connections=8192,
        access_log=False,
    )
    server = asyncio.ensure_future(serve(settings))
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as probe:
        for _ in range(300):
            try:
                async with probe.get(url + "/live") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    body = chat_bodies(1000, True)
    async with session(streams + 10) as client:
        await stream_once(client, url + "/v1/chat/completions", chat_bodies(2, True)())
        opened: list[aiohttp.ClientResponse] = []

        async def open_one() -> None:
            response = await client.post(url + "/v1/chat/completions", data=body(), headers=HEADERS)
            seen = 0
            # The first token's frame: the whole request state exists on the server.
            while seen < 2:
                seen += (await response.content.readany()).count(b"data: ")
            opened.append(response)

        gc.collect()
        tracemalloc.start(4)
        before = tracemalloc.take_snapshot()
        await asyncio.gather(*(open_one() for _ in range(streams)))
        await asyncio.sleep(1)
        gc.collect()
        after = tracemalloc.take_snapshot()
        filters = [tracemalloc.Filter(False, pattern) for pattern in CLIENT_SIDE]
        stats = after.filter_traces(filters).compare_to(before.filter_traces(filters), "lineno")
        print(f"{sum(s.size_diff for s in stats) / streams:.0f} B traced per open stream")
        for stat in stats[:top]:
            frame = stat.traceback[0]
            where = frame.filename.split("site-packages/")[-1]
            code = linecache.getline(frame.filename, frame.lineno).strip()[:70]
            print(f"{stat.size_diff / streams:7.0f} B  {where}:{frame.lineno}  {code}")
        for response in opened:
            response.close()
        # Let the server see the disconnects before it is stopped.
        await asyncio.sleep(2)
    server.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    asyncio.run(open_streams(args.streams, args.top))


if __name__ == "__main__":
    main()
