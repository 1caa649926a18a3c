"""``penstock serve`` as users run it: a real process on a loopback port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import REPO_ROOT, running_server, start_server


def test_serves_health_models_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    marker = tmp_path / "lifecycle.txt"
    engine = "tests.support.doubles:MarkedSampleEngine"
    with running_server(["--engine", engine, "--", "--marker", str(marker)], tmp_path) as server:
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 200 and health.json()["status"] == "healthy"
        assert httpx.get(f"{server.base_url}/live").status_code == 200
        models = httpx.get(f"{server.base_url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["sample-model"]
        assert server.stop(signal.SIGTERM) == 0
    assert marker.read_text().split() == ["start", "cleanup"]
    assert "engine cleaned up" in server.log()


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--graceful-shutdown-s", "20", "--", "--delay", "0.02"]
    with running_server(args, tmp_path) as server:
        body = {
            "model": "sample-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "stream": True,
        }
        frames: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if line:
                        frames.append(line)
                        streaming.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(timeout=30)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = httpx.get(f"{server.base_url}/v1/models")
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{server.base_url}/health").status_code == 503
        reader.join(timeout=30)
        assert frames[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in frames[-2]
        assert server.process.wait(timeout=30) == 0


def test_requests_open_when_the_grace_period_ends_get_a_last_message(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--graceful-shutdown-s", "1", "--", "--delay", "0.05"]
    with running_server(args, tmp_path) as server:
        url = f"{server.base_url}/v1/completions"
        body = {"model": "sample-model", "prompt": "x", "max_tokens": 1000}
        frames: list[str] = []
        answers: list[httpx.Response] = []
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
                for line in response.iter_lines():
                    if line:
                        frames.append(line)
                        streaming.set()

        readers = [
            threading.Thread(target=stream),
            threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=30))),
        ]
        for reader in readers:
            reader.start()
        assert streaming.wait(timeout=30)
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=30)
        assert server.process.wait(timeout=30) == 3

    assert frames[-1] == "data: [DONE]"
    assert all(json.loads(frame.removeprefix("data: ")) for frame in frames[:-1])
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "service_unavailable"
    assert "choices" in json.loads(frames[-3].removeprefix("data: "))
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "server_shutdown"
    log = server.log()
    assert log.count("grace period over") == 1
    assert "cut 2 open requests, 1 of them streams" in log
    assert "Traceback" not in log


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--graceful-shutdown-s", "60", "--", "--delay", "0.05"]
    with running_server(args, tmp_path) as server:
        body = {"model": "sample-model", "prompt": "x", "max_tokens": 1000, "stream": True}
        client = httpx.Client(timeout=30)
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert server.process.poll() is None
            assert next(lines) is not None
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            code = server.process.wait(timeout=10)
        assert code == 128 + signal.SIGINT
        assert time.monotonic() - started < 5


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "penstock", "serve", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )


def test_unknown_engine_lists_the_builtins() -> None:
    result = run_cli("--engine", "nope")
    assert result.returncode != 0
    assert "unknown engine 'nope'" in result.stderr
    for name in ("sample", "sample-diffusion", "transformers", "diffusion"):
        assert name in result.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module:Engine", "cannot import engine module 'no_such_module'"),
        ("tests.support.doubles:Missing", "has no attribute 'Missing'"),
        ("tests.support.doubles:NotAnEngine", "is not an engine"),
    ],
)
def test_bad_engine_classes_are_explained(spec: str, message: str) -> None:
    result = run_cli("--engine", spec)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_failing_start_cleans_up_prints_the_error_and_exits_nonzero(tmp_path: Path) -> None:
    marker = tmp_path / "lifecycle.txt"
    result = run_cli(
        "--engine", "tests.support.doubles:FailingStartEngine", "--", "--marker", str(marker)
    )
    assert result.returncode == 1
    assert "checkpoint /nowhere is unreadable" in result.stderr
    assert marker.read_text().split() == ["start", "cleanup"]


def test_invalid_engine_arguments_print_the_engine_usage() -> None:
    result = run_cli("--engine", "sample", "--", "--delay", "soon")
    assert result.returncode == 2
    assert "usage: penstock serve --engine sample --" in result.stderr
    assert "--delay" in result.stderr


def test_engine_args_after_double_dash_reach_the_engine(tmp_path: Path) -> None:
    server = start_server(["--engine", "sample", "--", "--max-tokens", "3"], tmp_path)
    try:
        body = {"model": "sample-model", "prompt": "x"}
        body["max_tokens"] = None
        response = httpx.post(f"{server.base_url}/v1/completions", json=body)
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_a_failing_canary_turns_health_503_with_the_reason(tmp_path: Path) -> None:
    canary = '{"token_ids": [1], "extra_args": {"mode": "raise_first"}}'
    args = ["--engine", "tests.support.doubles:ScriptedEngine", "--health-check-payload", canary]
    env = {"DYN_ENGINE_HEALTH_CHECK_INTERVAL": "0.1"}
    with running_server(args, tmp_path, env=env) as server:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = httpx.get(f"{server.base_url}/health")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy"
        assert "health canary failed" in health.json()["reason"]
        assert httpx.get(f"{server.base_url}/live").status_code == 200


def test_unknown_fields_are_ignored_and_named_unless_the_operator_refuses_them(
    tmp_path: Path,
) -> None:
    body = {"model": "sample-model", "prompt": "x", "max_tokens": 2, "vendor_knob": 3}
    with running_server(["--engine", "sample", "--", "--delay", "0"], tmp_path) as server:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-penstock-ignored-fields"] == "vendor_knob"
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}
        ) as streamed:
            assert streamed.headers["x-penstock-ignored-fields"] == "vendor_knob"
        assert "vendor_knob" in server.log()
    strict = ["--engine", "sample", "--no-allow-unknown-fields", "--", "--delay", "0"]
    with running_server(strict, tmp_path) as server:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "unknown_field"
        assert response.json()["error"]["param"] == "vendor_knob"


def test_version_is_served_without_a_key(tmp_path: Path) -> None:
    with running_server(["--engine", "sample", "--api-key", "k"], tmp_path) as server:
        response = httpx.get(f"{server.base_url}/version")
        assert response.status_code == 200
        assert response.json() == {"version": "0.1.0"}
