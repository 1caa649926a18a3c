"""Penstock on Ray Serve vs the single-process server, side by side in one run.

Every setup serves the zero-delay sample engine (so the path, not the engine, is
measured) and all of them run at once; each of ``--rounds`` rounds then loads each setup
in turn (the order rotating), so every setup meets the shared machine's load alike. A
round takes ``bench/lean_load.py``'s streaming load twice: at ``--concurrency``
(tokens/s, and the server CPU spent per 1,000 streamed tokens, from ``/proc/<pid>/stat``
of the serving processes around the run) and at concurrency 1 (TTFT). Each fleet figure
is compared with the single process of the same round; the summary gives the median over
the rounds. The setups:

* ``single process``: plain ``penstock serve``;
* ``fleet, N replica(s)``: ``penstock serve --ray`` on a local cluster of its own, the
  data plane one TCP connection per replica (``penstock.ray.streams``); its CPU is the
  ingress's plus every Serve replica process's (Ray's own daemons are left out);
* ``single process, again`` last: how far the shared machine's load moved meanwhile;
* ``forwarded bytes`` (with ``--forwarded``): the other data plane design, each replica
  running the whole gateway and the ingress forwarding its HTTP bytes
  (``bench/byte_forwarder.py`` in front of a plain ``penstock serve``); its CPU is the
  forwarder's plus the server's.

* ``fleet, N replica(s), before`` (with ``--before TREE``): the same fleets run from
  another checkout (the data plane before a change), in the same rounds;
* ``fleet, 1 replica, pinned`` (with ``--pinned``): the ingress's threads on CPU 0, the
  replica's and the load's on CPU 1: the tokens/s one ingress core streams, and how busy
  that core was (``ingress_cpu_s_per_s``).

``ingress_tokens_per_core_s`` is the tokens one core of the ingress alone streams at the
measured CPU cost per token.

``client_cpu_s_per_1k_tokens`` is the load's own CPU, to tell when the client caps a run.

    python bench/ray_serve.py [--replicas 1 2] [--rounds 3] [--pinned] [--before TREE]
        [--forwarded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from lean_load import run

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
def started(argv: list[str], tree: Path = REPO) -> Iterator[subprocess.Popen[bytes]]:
    # The replicas too (Ray's workers inherit it) import that tree's penstock. Ray's
    # ~20 s window to reach a cluster's GCS runs out on two cores loaded by other work.
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_gcs_server_port_wait_time_s": "120"}
    process = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Serving:
    """A running setup: its URL and the processes whose CPU counts (ingress, replicas)."""

    url: str
    ingress: int
    replicas: list[int]

    def cpu(self) -> dict[str, float]:
        return {
            "ingress": cpu_seconds(self.ingress),
            "replicas": sum(cpu_seconds(pid) for pid in self.replicas),
        }


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), {cpu})


@contextlib.contextmanager
def penstock(port: int, gateway_args: list[str], tree: Path = REPO) -> Iterator[Serving]:
    with started(serve_argv(port, gateway_args), tree) as process:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        yield Serving(url, process.pid, replica_pids(process.pid))


@contextlib.contextmanager
def pinned(port: int) -> Iterator[Serving]:
    """One replica; the ingress on CPU 0, the replica on CPU 1 (the load joins it there)."""
    fleet = ["--ray", "--ray-replicas", "1", "--ray-replica-cpus", "0.5"]
    with penstock(port, fleet) as serving:
        pin(serving.ingress, 0)
        for pid in serving.replicas:
            pin(pid, 1)
        yield serving


@contextlib.contextmanager
def forwarded(port: int) -> Iterator[Serving]:
    forwarder = [sys.executable, str(REPO / "bench" / "byte_forwarder.py"), "--port", str(port)]
    forwarder += ["--upstream", f"http://127.0.0.1:{port + 1}"]
    with started(serve_argv(port + 1, [])) as replica:
        wait_healthy(f"http://127.0.0.1:{port + 1}", replica)
        with started(forwarder) as ingress:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, ingress)
            yield Serving(url, ingress.pid, [replica.pid])


def load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    return asyncio.run(run(url, "sample-model", concurrency, requests, max_tokens))


def idle_cpu(serving: Serving) -> float:
    """What the serving processes spend idle (Ray's threads, the fleet view), per second."""
    before = sum(serving.cpu().values())
    time.sleep(IDLE_S)
    return round((sum(serving.cpu().values()) - before) / IDLE_S, 4)


def measure(name: str, serving: Serving, args: argparse.Namespace) -> dict:
    # The load runs beside a pinned setup's replica, on its core.
    affinity = os.sched_getaffinity(0)
    if name.endswith("pinned"):
        os.sched_setaffinity(0, {1})
    try:
        before, started_at = serving.cpu(), time.perf_counter()
        client_before = time.process_time()
        busy = load(serving.url, args.concurrency, args.requests, args.max_tokens)
        client = time.process_time() - client_before
        after, elapsed = serving.cpu(), time.perf_counter() - started_at
        serial = load(serving.url, 1, args.serial, args.max_tokens)
    finally:
        os.sched_setaffinity(0, affinity)
    # ``run`` warms up with one request per connection first, inside the CPU reading.
    tokens = max((busy["requests"] + args.concurrency) * busy["mean_tokens"], 1)
    spent = {part: after[part] - before[part] for part in after}
    per_1k = {part: 1000 * seconds / tokens for part, seconds in spent.items()}
    ingress_per_token = spent["ingress"] / tokens
    return {
        "setup": name,
        "tokens_per_s": round(busy["tokens_per_s"]),
        "errors": busy["errors"] + serial["errors"],
        "cpu_s_per_1k_tokens": round(sum(per_1k.values()), 4),
        "ingress_cpu_s_per_1k_tokens": round(per_1k["ingress"], 4),
        "replica_cpu_s_per_1k_tokens": round(per_1k["replicas"], 4),
        "ingress_cpu_s_per_s": round(spent["ingress"] / elapsed, 3),
        "client_cpu_s_per_1k_tokens": round(1000 * client / tokens, 4),
        "ingress_tokens_per_core_s": round(1 / ingress_per_token) if ingress_per_token else None,
        "ttft_p50_ms_c1": round(serial["ttft_p50_ms"], 2),
        "ttft_p99_ms_c1": round(serial["ttft_p99_ms"], 2),
    }


def against_single(row: dict, single: dict) -> dict:
    return {
        "cpu_per_token_vs_single": row["cpu_s_per_1k_tokens"] / single["cpu_s_per_1k_tokens"],
        "tokens_per_s_vs_single": row["tokens_per_s"] / single["tokens_per_s"],
        "ttft_overhead_ms_c1": row["ttft_p50_ms_c1"] - single["ttft_p50_ms_c1"],
    }


def summary(name: str, rows: list[dict], ratios: list[dict]) -> dict:
    """The median over the rounds of each figure, and of each round's ratio to the single
    process."""
    figures = {**rows[0], **(ratios[0] if ratios else {})}
    out: dict[str, Any] = {"setup": name, "rounds": len(rows)}
    for key, value in figures.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in (ratios if ratios and key in ratios[0] else rows)]
            values = [v for v in values if v is not None]
            out[key] = round(statistics.median(values), 4) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--serial", type=int, default=32, help="requests one at a time (TTFT)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pinned", action="store_true", help="also the pinned 1-replica fleet")
    parser.add_argument("--forwarded", action="store_true", help="also the byte forwarder")
    parser.add_argument("--port", type=int, default=18620)
    parser.add_argument("--before", type=Path, help="also the fleets of this tree")
    args = parser.parse_args()
    setups: list[tuple[str, Any]] = [("single process", lambda port: penstock(port, []))]
    for n in args.replicas:
        fleet = ["--ray", "--ray-replicas", str(n), "--ray-replica-cpus", "0.5"]
        setups.append((f"fleet, {n} replica(s)", lambda port, f=fleet: penstock(port, f)))
    if args.before:
        for n in args.replicas:
            fleet = ["--ray", "--ray-replicas", str(n), "--ray-replica-cpus", "0.5"]
            before = functools.partial(penstock, gateway_args=fleet, tree=args.before.resolve())
            setups.append((f"fleet, {n} replica(s), before", before))
    if args.pinned:
        setups.append(("fleet, 1 replica, pinned", pinned))
    if args.forwarded:
        setups.append(("forwarded bytes, 1 replica", forwarded))
    with contextlib.ExitStack() as stack:
        # One at a time: Ray clusters starting side by side on two loaded cores time out.
        running = {
            name: stack.enter_context(start(args.port + 2 * index))
            for index, (name, start) in enumerate(setups)
        }
        for name, serving in running.items():
            print(json.dumps({"setup": name, "idle_cpu_s_per_s": idle_cpu(serving)}), flush=True)
        rows: dict[str, list[dict]] = {name: [] for name in running}
        ratios: dict[str, list[dict]] = {name: [] for name in running}
        names = list(running)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            measured = {name: measure(name, running[name], args) for name in order}
            for name in names:
                rows[name].append(measured[name])
                print(json.dumps({"round": round_, **measured[name]}), flush=True)
                if name != names[0]:
                    ratios[name].append(against_single(measured[name], measured[names[0]]))
    for name in names:
        print(json.dumps(summary(name, rows[name], ratios[name])), flush=True)


if __name__ == "__main__":
    main()
