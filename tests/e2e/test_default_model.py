"""``penstock serve`` with the transformers engine, started the way the README says."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server import REPO_ROOT, free_port

# The first start converts the default model (about a minute here; more on a busy machine).
READY_TIMEOUT_S = 600.0


def _penstock_command() -> list[str]:
    script = Path(sys.executable).with_name("penstock")
    return [str(script)] if script.exists() else [sys.executable, "-m", "penstock"]


def _serve(args: list[str], log_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    with log_path.open("w") as log:
        return subprocess.Popen(
            [*_penstock_command(), "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            text=True,
        )


def _wait_healthy(process: subprocess.Popen[str], base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"server not healthy in {READY_TIMEOUT_S}s:\n{log_path.read_text()}")


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    process = _serve(["--port", str(port)], log_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, base_url, log_path)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
        assert "Paris" in reply.choices[0].message.content
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_missing_checkpoint_stops_startup_with_a_clear_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    log_path = tmp_path / "serve.log"
    process = _serve(["--port", str(free_port()), "--model", str(missing)], log_path)
    try:
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert code != 0
    assert f"model checkpoint not found: {missing}" in log_path.read_text()
