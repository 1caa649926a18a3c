"""Penstock on Ray Serve vs the single-process server, side by side in one run.

Each setup serves the zero-delay sample engine (so the path, not the engine, is measured)
and takes ``bench/load.py``'s streaming load twice: at ``--concurrency`` (tokens/s, and
the server CPU spent per 1,000 streamed tokens, from ``/proc/<pid>/stat`` of the
serving processes around the run) and at concurrency 1 (TTFT). The setups:

* ``single process``: plain ``penstock serve``;
* ``fleet, N replica(s)``: ``penstock serve --ray`` on a local cluster of its own, the
  data plane one TCP connection per replica (``penstock.ray.streams``); its CPU is the
  ingress's plus every Serve replica process's (Ray's own daemons are left out);
* ``single process, again`` last: how far the shared machine's load moved meanwhile;
* ``forwarded bytes`` (with ``--forwarded``): the other data plane design, each replica
  running the whole gateway and the ingress forwarding its HTTP bytes
  (``bench/byte_forwarder.py`` in front of a plain ``penstock serve``); its CPU is the
  forwarder's plus the server's.

``ingress_tokens_per_core_s`` is the tokens one core of the ingress alone streams at the
measured CPU cost per token.

    python bench/ray_serve.py [--replicas 1 2] [--concurrency 16] [--forwarded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import run

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
IDLE_S = 3.0


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def replica_pids(root: int) -> list[int]:
    """The Serve replica processes below ``root`` (its own local Ray cluster)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
    below = {root}
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in below and pid not in below:
                below.add(pid)
                changed = True
    found = []
    for pid in below - {root}:
        with contextlib.suppress(OSError):
            if b"ServeReplica" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy in 180 s")


def serve_argv(port: int, gateway_args: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "penstock", "serve", "--port", str(port), "--log-level"]
    return [*argv, "warning", *gateway_args, "--engine", "sample", "--", "--delay", "0"]


@contextlib.contextmanager
def started(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def penstock(port: int, gateway_args: list[str]) -> Iterator[tuple[str, Callable[[], dict]]]:
    """The server's URL and a reading of its CPU seconds: ingress, replicas."""
    with started(serve_argv(port, gateway_args)) as process:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        replicas = replica_pids(process.pid)

        def cpu() -> dict:
            return {
                "ingress": cpu_seconds(process.pid),
                "replicas": sum(cpu_seconds(pid) for pid in replicas),
            }

        yield url, cpu


@contextlib.contextmanager
def forwarded(port: int) -> Iterator[tuple[str, Callable[[], dict]]]:
    forwarder = [sys.executable, str(REPO / "bench" / "byte_forwarder.py"), "--port", str(port)]
    forwarder += ["--upstream", f"http://127.0.0.1:{port + 1}"]
    with started(serve_argv(port + 1, [])) as replica:
        wait_healthy(f"http://127.0.0.1:{port + 1}", replica)
        with started(forwarder) as ingress:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, ingress)

            def cpu() -> dict:
                return {"ingress": cpu_seconds(ingress.pid), "replicas": cpu_seconds(replica.pid)}

            yield url, cpu


def load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    args = argparse.Namespace(
        url=url,
        model="sample-model",
        concurrency=concurrency,
        requests=requests,
        max_tokens=max_tokens,
    )
    return asyncio.run(run(args))


def measure(name: str, serving: Any, args: argparse.Namespace) -> dict:
    with serving as (url, cpu):
        # What the serving processes spend idle (Ray's threads, the fleet view), per second.
        idle_before = cpu()
        time.sleep(IDLE_S)
        idle_after = cpu()
        before = cpu()
        busy = load(url, args.concurrency, args.requests, args.max_tokens)
        after = cpu()
        serial = load(url, 1, 32, args.max_tokens)
    # ``load.run`` warms up with up to 8 requests of its own first, inside the CPU reading.
    tokens = max((busy["requests"] + min(args.concurrency, 8)) * busy["mean_tokens"], 1)
    spent = {part: after[part] - before[part] for part in after}
    per_1k = {part: 1000 * seconds / tokens for part, seconds in spent.items()}
    ingress_per_token = spent["ingress"] / tokens
    idle = sum(idle_after.values()) - sum(idle_before.values())
    return {
        "setup": name,
        "idle_cpu_s_per_s": round(idle / IDLE_S, 4),
        "tokens_per_s": round(busy["tokens_per_s"]),
        "errors": busy["errors"] + serial["errors"],
        "cpu_s_per_1k_tokens": round(sum(per_1k.values()), 4),
        "ingress_cpu_s_per_1k_tokens": round(per_1k["ingress"], 4),
        "replica_cpu_s_per_1k_tokens": round(per_1k["replicas"], 4),
        "ingress_tokens_per_core_s": round(1 / ingress_per_token) if ingress_per_token else None,
        "ttft_p50_ms_c1": round(serial["ttft_p50_ms"], 2),
        "ttft_p99_ms_c1": round(serial["ttft_p99_ms"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--forwarded", action="store_true", help="also the byte forwarder")
    parser.add_argument("--port", type=int, default=18620)
    args = parser.parse_args()
    setups: list[tuple[str, Any]] = [("single process", penstock(args.port, []))]
    for n in args.replicas:
        fleet = ["--ray", "--ray-replicas", str(n), "--ray-replica-cpus", "0.5"]
        setups.append((f"fleet, {n} replica(s)", penstock(args.port, fleet)))
    if args.forwarded:
        setups.append(("forwarded bytes, 1 replica", forwarded(args.port)))
    # Again at the end: how far the machine's load moved during the run.
    setups.append(("single process, again", penstock(args.port, [])))
    rows = []
    for name, serving in setups:
        rows.append(measure(name, serving, args))
        print(json.dumps(rows[-1]), flush=True)
    single = rows[0]
    for row in rows[1:-1]:
        ratios = {
            "setup": row["setup"],
            "cpu_per_token_vs_single": round(
                row["cpu_s_per_1k_tokens"] / single["cpu_s_per_1k_tokens"], 2
            ),
            "tokens_per_s_vs_single": round(row["tokens_per_s"] / single["tokens_per_s"], 2),
            "ttft_overhead_ms_c1": round(row["ttft_p50_ms_c1"] - single["ttft_p50_ms_c1"], 2),
        }
        print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
