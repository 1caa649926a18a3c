"""``docs/rl-trainers.md`` against the app: every call its tables list is a route the app
serves with that method, and ``/engine/capabilities`` lists each trainer route under its
dialect."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from penstock.app.factory import create_app
from penstock.gateway import Gateway

DOC = Path(__file__).resolve().parents[2] / "docs" / "rl-trainers.md"
# A route cell: `POST /path?query`, or a bare `/path` in a row listing several.
ROUTE = re.compile(r"`(?:(GET|POST) )?(/[^`?\s]*)[^`]*`")
# Routes of the OpenAI API, the server's own health, tokenizers and pooling, served
# beside every dialect.
SHARED = frozenset(
    {
        "/health",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/classify",
    }
)


def documented_calls() -> list[tuple[str | None, str]]:
    """``(method, path)`` of every call in the framework tables (their route column)."""
    calls = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) < 4 or not cells[2].startswith("`"):
            continue
        calls += [(method or None, path) for method, path in ROUTE.findall(cells[2])]
    return calls


def test_the_doc_lists_the_calls() -> None:
    calls = documented_calls()
    assert ("POST", "/pull_weights") in calls and ("POST", "/fetch_weights") in calls
    assert len(calls) > 60


def test_every_documented_call_is_served(gateway: Gateway) -> None:
    paths = create_app(gateway).openapi()["paths"]
    served = {(verb.upper(), path) for path, operations in paths.items() for verb in operations}
    missing = [
        (method, path)
        for method, path in documented_calls()
        if not any(path == route and method in (None, verb) for verb, route in served)
    ]
    assert not missing


async def test_capabilities_list_every_trainer_route(client: httpx.AsyncClient) -> None:
    dialects = (await client.get("/engine/capabilities")).json()["dialects"]
    listed = set(dialects["sglang"]) | set(dialects["vllm"])
    missing = {path for _, path in documented_calls() if path not in SHARED} - listed
    assert not missing
    # Served routes only: each listed path is one the app answers.
    assert "/engine/capabilities" not in listed
    assert {"/pull_weights", "/post_process_weights", "/start_profile"} <= set(dialects["sglang"])
    assert {"/fetch_weights", "/collective_rpc", "/generate/"} <= set(dialects["vllm"])
