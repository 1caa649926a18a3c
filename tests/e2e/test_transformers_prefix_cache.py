"""Prefix caching seen through the OpenAI surface of ``penstock serve --engine
transformers``: a system prompt sent again reports ``cached_tokens`` and answers the
same, ``/reset_prefix_cache`` forgets it, ``/metrics`` shows the cached blocks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "k"
SYSTEM = "Answer in one short line and name the shelf. " * 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    with transformers_server(
        model_dir,
        tmp_path_factory.mktemp("serve"),
        "--admin-api-key",
        ADMIN_KEY,
        "--scheduling-policy",
        "priority",
    ) as process:
        yield process


def ask(
    client: openai.OpenAI, question: str, cache_salt: str | None = None
) -> tuple[str, int, int]:
    """The answer, the prompt's token count and its cached tokens."""
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        extra_body={} if cache_salt is None else {"cache_salt": cache_salt},
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, cached


def test_a_system_prompt_seen_before_is_reported_cached_until_reset(
    server: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    answer, prompt_tokens, cold = ask(client, "Where are the hinges?")
    again, _, warm = ask(client, "Where are the hinges?")
    assert cold == 0
    # Every full block of 16 but the one holding the last prompt token.
    assert warm == 16 * ((prompt_tokens - 1) // 16) > 0
    assert again == answer
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "penstock_engine_kv_cached_blocks" in metrics
    # The engine's KV events reach the gateway's families (what --ray prefix routing reads).
    stored = re.search(
        r'penstock_component_kv_events_total\{[^}]*kind="stored"[^}]*\} (\S+)', metrics
    )
    assert stored is not None and float(stored.group(1)) > 0
    reset = httpx.post(
        f"{server.base_url}/reset_prefix_cache",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    assert reset.status_code == 200, reset.text
    after, _, cached = ask(client, "Where are the hinges?")
    assert (after, cached) == (answer, 0)


def test_priority_reaches_the_engine_that_orders_by_it(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Where are the hinges?"}],
        max_tokens=4,
        extra_body={"priority": -3},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    refused = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": model, "prompt": "hinges", "max_tokens": 2, "priority": "high"},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "priority"


def test_a_cache_salt_keeps_a_prompt_from_matching_another_salts_blocks(
    server: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    answer, prompt_tokens, cold = ask(client, "Which aisle has paint?", cache_salt="team-a")
    other = ask(client, "Which aisle has paint?", cache_salt="team-b")
    same = ask(client, "Which aisle has paint?", cache_salt="team-a")
    assert (cold, other[2]) == (0, 0)
    assert same[2] == 16 * ((prompt_tokens - 1) // 16) > 0
    assert other[0] == same[0] == answer
