"""The two servers the differential suite talks to: vLLM's OpenAI server and ``penstock
serve``, both on the default model folder in float32, each on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.server import REPO_ROOT, ServerProcess, free_port, start_server

SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# SmolLM2 speaks ChatML, whose tool-call convention is Hermes' <tool_call> blocks.
TOOL_CALL_PARSER = "hermes"
# The first start converts the default model and builds Penstock's CPU kernels; vLLM's
# start imports for a minute or two on a busy machine.
READY_TIMEOUT_S = 900.0


def start_penstock(log_dir: Path) -> ServerProcess:
    """``penstock serve`` on the default model, its weights kept in float32 as vLLM's are."""
    return start_server(
        ["--tool-call-parser", TOOL_CALL_PARSER, "--", "--cpu-weight-dtype", "float32"],
        log_dir,
        env={"HF_HUB_OFFLINE": "1"},
        wait_ready=False,
    )


def start_vllm(python: Path, model_dir: Path, log_dir: Path) -> ServerProcess:
    """vLLM's API server module (its ``vllm serve`` CLI looks up the metadata of a package
    named ``vllm``, which the CPU wheel does not provide)."""
    port = free_port()
    log_path = log_dir / f"vllm-{port}.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
    }
    env.pop("PYTHONPATH", None)
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        # Eager: the same tokens and logprobs as its compiled graphs, without the minutes
        # torch.compile takes at every start (vLLM 0.32's CPU build fails to load its
        # compile cache and compiles again).
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        TOOL_CALL_PARSER,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, text=True
        )
    return ServerProcess(process, port, log_path)


def wait_healthy(server: ServerProcess, name: str, deadline: float) -> None:
    """Wait until ``/health`` answers 200; raise with the server's log otherwise."""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {server.process.returncode}:\n{server.log()[-8000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{name} not healthy in {READY_TIMEOUT_S}s:\n{server.log()[-8000:]}")


def stop(server: ServerProcess) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@contextlib.contextmanager
def both_servers(
    vllm_python: Path, model_dir: Path, log_dir: Path
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(vLLM, Penstock), both healthy; their starts overlap."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    vllm = start_vllm(vllm_python, model_dir, log_dir)
    penstock = start_penstock(log_dir)
    try:
        wait_healthy(penstock, "penstock serve", deadline)
        wait_healthy(vllm, "vLLM", deadline)
        yield vllm, penstock
    finally:
        stop(penstock)
        stop(vllm)


@contextlib.contextmanager
def penstock_only(log_dir: Path) -> Iterator[ServerProcess]:
    """``penstock serve`` alone, healthy, for a suite pointed at a vLLM already running."""
    penstock = start_penstock(log_dir)
    try:
        wait_healthy(penstock, "penstock serve", time.monotonic() + READY_TIMEOUT_S)
        yield penstock
    finally:
        stop(penstock)
