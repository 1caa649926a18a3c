"""Penstock on Ray Serve vs the single-process server, side by side in one run.

For each setup (single process, ``--ray`` with 1, 2 and 4 replicas by default; the
Ray ones start their own local cluster) it starts ``penstock serve`` on the sample engine
and runs ``bench/load.py``'s streaming load twice:

* engine-bound (``--delay 0.01`` s per token): throughput and TTFT as replicas are added;
* zero-delay engine: what the path costs per streamed chunk (ms of wall time per token at
  concurrency 1, so the difference to the single process is the ingress overhead).

    python bench/ray_serve.py [--replicas 1 2 4] [--concurrency 16] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import run

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def server(port: int, gateway_args: list[str], delay: float) -> Iterator[str]:
    argv = [sys.executable, "-m", "penstock", "serve", "--port", str(port), "--log-level"]
    argv += ["warning", *gateway_args, "--engine", "sample", "--", "--delay", str(delay)]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=90)


def load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    args = argparse.Namespace(
        url=url,
        model="sample-model",
        concurrency=concurrency,
        requests=requests,
        max_tokens=max_tokens,
    )
    return asyncio.run(run(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=18620)
    args = parser.parse_args()
    setups: list[tuple[str, list[str]]] = [("single process", [])]
    setups += [
        (f"ray, {n} replica(s)", ["--ray", "--ray-replicas", str(n), "--ray-replica-cpus", "0.5"])
        for n in args.replicas
    ]
    rows = []
    for name, gateway_args in setups:
        with server(args.port, gateway_args, 0.01) as url:
            bound = load(url, args.concurrency, args.requests, args.max_tokens)
        with server(args.port, gateway_args, 0.0) as url:
            serial = load(url, 1, 16, 64)
        per_chunk_ms = 1000 / serial["tokens_per_s"] if serial["tokens_per_s"] else 0.0
        row = {
            "setup": name,
            "tokens_per_s": round(bound["tokens_per_s"]),
            "ttft_p50_ms": round(bound["ttft_p50_ms"], 1),
            "ttft_p99_ms": round(bound["ttft_p99_ms"], 1),
            "errors": bound["errors"],
            "ms_per_chunk_c1_zero_delay": round(per_chunk_ms, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
