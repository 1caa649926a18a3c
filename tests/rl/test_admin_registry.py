"""RLRouteRegistry, the RL request validators and small helpers, message for message."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from penstock.rl import (
    RLAdminValidationError,
    RLRouteRegistry,
    env_bool,
    first_endpoint_response,
    require_lora_load_request,
    require_lora_unload_request,
)

URI_REQUIRED = "'source.uri' is required and must be a string"


class Runtime:
    def __init__(self, url: str | None) -> None:
        self.url = url

    def system_status_server_url(self) -> str | None:
        return self.url


async def handler(body: dict[str, Any]) -> dict[str, Any]:
    return {"status": "ok"}


def test_describe_lists_sorted_routes_with_system_url_and_world_size() -> None:
    registry = RLRouteRegistry(Runtime("http://10.0.0.1:9000"), world_size=4)
    registry.add_routes({"resume_generation": handler, "pause_generation": handler})
    registry.add_route("flush_cache", handler)
    assert registry.describe() == {
        "status": "ok",
        "routes": ["flush_cache", "pause_generation", "resume_generation"],
        "system_url": "http://10.0.0.1:9000",
        "world_size": 4,
    }


def test_describe_omits_a_missing_url_and_world_size() -> None:
    registry = RLRouteRegistry(Runtime(None))
    assert registry.describe() == {"status": "ok", "routes": []}


def test_add_route_replaces_a_handler_of_the_same_name() -> None:
    async def other(body: dict[str, Any]) -> dict[str, Any]:
        return {}

    registry = RLRouteRegistry(Runtime(None), logger_=logging.getLogger("test"))
    registry.add_route("x", handler)
    registry.add_route("x", other)
    assert registry.routes == {"x": other}


@pytest.mark.parametrize("world_size", [True, False, 0, -1, 1.5, "2"])
def test_world_size_must_be_a_positive_int(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        RLRouteRegistry(Runtime(None), world_size=world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (None, {"status": "error", "message": "rl_dispatch: request required"}),
        ([1], {"status": "error", "message": "rl_dispatch: request required"}),
        ({}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ({"method": ""}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ({"method": 3}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        (
            {"method": "pause_generation"},
            {
                "status": "error",
                "method": "pause_generation",
                "message": "rl request-plane endpoint only supports method='routes'",
            },
        ),
        (
            {"method": "routes", "kwargs": [1]},
            {
                "status": "error",
                "method": "routes",
                "message": "rl_dispatch: 'kwargs' must be an object",
            },
        ),
        ({"method": "routes", "kwargs": {}}, {"status": "ok", "routes": ["flush_cache"]}),
        ({"method": "routes"}, {"status": "ok", "routes": ["flush_cache"]}),
    ],
)
def test_dispatch_only_describes(request_: Any, expected: dict[str, Any]) -> None:
    registry = RLRouteRegistry(Runtime(None))
    registry.add_route("flush_cache", handler)
    assert registry.dispatch(request_) == expected


async def test_dispatch_stream_yields_exactly_the_dispatch_result() -> None:
    registry = RLRouteRegistry(Runtime(None))
    results = [item async for item in registry.dispatch_stream({"method": "routes"})]
    assert results == [{"status": "ok", "routes": []}]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), (" YES ", True), ("on", True), ("0", False), ("no", False)],
)
def test_env_bool(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("PENSTOCK_TEST_FLAG", value)
    assert env_bool("PENSTOCK_TEST_FLAG") is expected


def test_env_bool_unset_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PENSTOCK_TEST_FLAG", raising=False)
    assert env_bool("PENSTOCK_TEST_FLAG") is False
    assert env_bool("PENSTOCK_TEST_FLAG", default=True) is True


class Tracked:
    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.closed = False

    def __call__(self, body: Any) -> AsyncIterator[Any]:
        async def gen() -> AsyncIterator[Any]:
            try:
                for item in self.items:
                    yield item
            finally:
                self.closed = True

        return gen()


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (
            [{"status": "success", "lora_id": 1}, {"more": True}],
            {"status": "success", "lora_id": 1},
        ),
        ([None], {"status": "ok"}),
        ([{}], {"status": "ok"}),
        ([], {"status": "ok"}),
    ],
)
async def test_first_endpoint_response(items: list[Any], expected: dict[str, Any]) -> None:
    endpoint = Tracked(items)
    assert await first_endpoint_response(endpoint, {}) == expected
    assert endpoint.closed


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (None, "Request is required with 'lora_name' and 'source.uri'"),
        ("x", "Request is required with 'lora_name' and 'source.uri'"),
        ({"source": {"uri": "file:///a"}}, "'lora_name' is required and must be a string"),
        ({"lora_name": ["a"], "source": {}}, "'lora_name' is required and must be a string"),
        ({"lora_name": ""}, "'lora_name' is required and must be a string"),
        ({"lora_name": "a"}, "'source' object is required in request"),
        ({"lora_name": "a", "source": "file:///a"}, "'source' object is required in request"),
        ({"lora_name": "a", "source": {}}, "'source.uri' is required and must be a string"),
        ({"lora_name": "a", "source": {"uri": 5}}, "'source.uri' is required and must be a string"),
        (
            {"lora_name": "a", "source": {"uri": ""}},
            "'source.uri' is required and must be a string",
        ),
    ],
)
def test_lora_load_request_messages(request_: Any, message: str) -> None:
    with pytest.raises(RLAdminValidationError) as raised:
        require_lora_load_request(request_)
    assert str(raised.value) == message
    assert isinstance(raised.value, ValueError)


def test_lora_load_request_returns_name_and_uri() -> None:
    request = {"lora_name": "math", "source": {"uri": "s3://bucket/math"}}
    assert require_lora_load_request(request) == ("math", "s3://bucket/math")


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (None, "Request is required with 'lora_name' field"),
        ([], "Request is required with 'lora_name' field"),
        ({}, "'lora_name' is required and must be a string"),
        ({"lora_name": 1}, "'lora_name' is required and must be a string"),
    ],
)
def test_lora_unload_request_messages(request_: Any, message: str) -> None:
    with pytest.raises(RLAdminValidationError, match=f"^{message}$".replace("(", r"\(")):
        require_lora_unload_request(request_)
    assert require_lora_unload_request({"lora_name": "math"}) == "math"
