"""Schema-driven fuzzing of a real ``penstock serve`` from its own OpenAPI document.

Every operation the server documents is called with inputs schemathesis generates
(valid and invalid). No response may be a 5xx, every error on an OpenAI route is the
OpenAI error envelope, and the server stays healthy afterwards.

Two servers: inference and read-only routes run on one, the admin routes that change the
engine's lifecycle (pause, sleep, ...) on another, restored after every call, so a
generated ``pause?mode=keep`` cannot hold the inference cases hostage.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.server import ServerProcess, start_server

MAX_EXAMPLES = 12
CALL_TIMEOUT_S = 20.0
# Generated bodies may ask for any number of tokens; the engine answers at once.
SERVER_ARGS = ["--engine", "sample", "--", "--delay", "0", "--context-length", "512"]
LIFECYCLE_PATHS = (
    r"^/(pause|resume|sleep|wake_up|pause_generation|continue_generation"
    r"|release_memory_occupation|resume_memory_occupation|engine/)"
)
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


def _served_models(base_url: str) -> list[str]:
    models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    return [model["id"] for model in models]


def _sharpened(document: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """The server's own document, with what it cannot state: the served model names.

    Unknown body fields are ignored by default, which the generated JSON schema leaves
    open; closing them makes the generated bodies spend their fields on the declared ones.
    The raw document is fuzzed as well, so both paths are covered.
    """
    sharpened = copy.deepcopy(document)
    for component in sharpened.get("components", {}).get("schemas", {}).values():
        properties = component.get("properties", {})
        if "model" in properties and component.get("type") == "object":
            properties["model"] = {"type": "string", "enum": models}
            component["additionalProperties"] = False
    return sharpened


@pytest.fixture(scope="module")
def inference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(SERVER_ARGS, tmp_path_factory.mktemp("fuzz-inference"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lifecycle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(SERVER_ARGS, tmp_path_factory.mktemp("fuzz-lifecycle"))
    yield server
    server.stop()


def _document(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()


def _assert_answer_is_sound(case: Any, response: Any) -> None:
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    )
    if response.status_code >= 400 and case.path.startswith("/v1/"):
        error = response.json().get("error")
        assert isinstance(error, dict), response.text[:500]
        assert isinstance(error.get("message"), str) and error["message"], error
        assert isinstance(error.get("type"), str) and error["type"], error


def _fuzz(
    document: dict[str, Any],
    base_url: str,
    *,
    lifecycle: bool,
    after_call: Callable[[], None] = lambda: None,
) -> int:
    """Call every selected operation with generated valid and invalid inputs."""
    schema = schemathesis.openapi.from_dict(document)
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if bool(re.match(LIFECYCLE_PATHS, operation.path)) != lifecycle:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @FUZZ_SETTINGS
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case: Any) -> None:
                nonlocal calls
                response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S)
                calls += 1
                _assert_answer_is_sound(case, response)
                after_call()

            try:
                call()
            except Unsatisfiable:
                # An operation that takes no input has no invalid input to generate.
                assert mode is GenerationMode.NEGATIVE, operation.label
    return calls


def test_documented_operations_never_fail_on_generated_input(
    inference_server: ServerProcess,
) -> None:
    calls = _fuzz(_document(inference_server), inference_server.base_url, lifecycle=False)
    assert calls > 0


def test_generated_requests_for_served_models_never_fail(
    inference_server: ServerProcess,
) -> None:
    document = _sharpened(_document(inference_server), _served_models(inference_server.base_url))
    calls = _fuzz(document, inference_server.base_url, lifecycle=False)
    assert calls > 0


def test_generated_lifecycle_calls_never_fail(lifecycle_server: ServerProcess) -> None:
    def restore() -> None:
        for path in ("/wake_up", "/resume"):
            answer = httpx.post(f"{lifecycle_server.base_url}{path}", timeout=10)
            assert answer.status_code == 200, answer.text

    calls = _fuzz(
        _document(lifecycle_server), lifecycle_server.base_url, lifecycle=True, after_call=restore
    )
    assert calls > 0


def _assert_serving(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    model = _served_models(server.base_url)[0]
    answer = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_servers_keep_serving_after_fuzzing(
    inference_server: ServerProcess, lifecycle_server: ServerProcess, tmp_path: Path
) -> None:
    _assert_serving(inference_server)
    _assert_serving(lifecycle_server)
    for server in (inference_server, lifecycle_server):
        assert "Traceback" not in server.log(), server.log()[-3000:]
