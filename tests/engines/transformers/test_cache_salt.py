"""vLLM's ``cache_salt``: cached KV blocks are shared only between requests of one salt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.helpers import greedy, hf_greedy, run

# Two full blocks of 16 and eight tokens more.
PROMPT = [(7 * i) % 50 + 3 for i in range(40)]


def salted(salt: str | None) -> dict[str, Any]:
    request = greedy(PROMPT, max_tokens=8)
    if salt is not None:
        request["cache_salt"] = salt
    return request


async def cached_tokens(engine: TransformersEngine, salt: str | None) -> tuple[int, list[int]]:
    choice = (await run(engine, salted(salt)))[0]
    assert choice.usage is not None
    return choice.usage["prompt_tokens_details"]["cached_tokens"], choice.token_ids


async def test_a_prompt_hits_the_cache_only_under_the_salt_it_was_cached_with(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    first = await cached_tokens(engine, "tenant-a")
    other_salt = await cached_tokens(engine, "tenant-b")
    unsalted = await cached_tokens(engine, None)
    same_salt = await cached_tokens(engine, "tenant-a")
    assert [first[0], other_salt[0], unsalted[0], same_salt[0]] == [0, 0, 0, 32]
    expected = hf_greedy(tiny_model_dir, PROMPT, 8)
    assert first[1] == other_salt[1] == unsalted[1] == same_salt[1] == expected


async def test_an_unsalted_prompt_is_not_matched_by_a_salted_one(
    engine: TransformersEngine,
) -> None:
    assert (await cached_tokens(engine, None))[0] == 0
    assert (await cached_tokens(engine, "tenant-a"))[0] == 0
    assert (await cached_tokens(engine, None))[0] == 32


@pytest.mark.parametrize("salt", ["", 7])
async def test_a_cache_salt_that_is_not_a_non_empty_string_is_refused(
    engine: TransformersEngine, salt: object
) -> None:
    request = {**greedy(PROMPT, max_tokens=2), "cache_salt": salt}
    with pytest.raises(ValueError, match="cache_salt"):
        await run(engine, request)
