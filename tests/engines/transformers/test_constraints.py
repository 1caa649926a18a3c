"""Constrained rows in the transformers engine's batch, beside free ones."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from penstock.engines.context import Context
from penstock.engines.engine_errors import engine_exception_to_error
from penstock.engines.guided_specs import MAX_SCHEMA_DEPTH, parse_guided_decoding
from penstock.engines.transformers import TransformersEngine
from penstock.errors import NotInstalledError
from penstock.extras import XGRAMMAR_INSTALL
from tests.engines.transformers.helpers import greedy, run

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["word", "count"],
}


def sampled(guided: dict[str, Any] | None, *, n: int, seed: int) -> dict[str, Any]:
    request = greedy(max_tokens=120)
    request["stop_conditions"]["ignore_eos"] = False
    request["sampling_options"] = {"temperature": 1.0, "seed": seed, "n": n}
    if guided is not None:
        request["sampling_options"]["guided_decoding"] = guided
    return request


async def test_constrained_and_free_rows_share_a_batch(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    alone = await run(engine, sampled(None, n=2, seed=3))
    free, constrained = await asyncio.gather(
        run(engine, sampled(None, n=2, seed=3), Context("free")),
        run(engine, sampled({"json": SCHEMA}, n=4, seed=5), Context("json")),
    )
    # A free row draws the same tokens whether or not a constrained one shares its steps.
    assert [c.token_ids for c in free.values()] == [c.token_ids for c in alone.values()]
    for choice in constrained.values():
        assert choice.finish_reason == "stop"
        value = json.loads(tokenizer.decode(choice.token_ids, skip_special_tokens=True))
        # Properties in the schema's order, as xgrammar writes them.
        assert list(value) == ["word", "count"] and 0 <= value["count"] <= 99
        assert len(value["word"]) <= 8


async def test_the_grammar_ends_the_sequence_even_with_ignore_eos(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    request = sampled({"regex": "[ab]{3}"}, n=3, seed=1)
    request["stop_conditions"]["ignore_eos"] = True
    for choice in (await run(engine, request)).values():
        assert choice.finish_reason == "stop"
        assert re.fullmatch("[ab]{3}", tokenizer.decode(choice.token_ids, skip_special_tokens=True))


async def test_a_regex_that_cannot_compile_fails_before_any_token(
    engine: TransformersEngine,
) -> None:
    with pytest.raises(ValueError, match=r"guided_decoding\.regex is not supported"):
        await run(engine, sampled({"regex": "(["}, n=1, seed=0))


async def test_without_xgrammar_a_constrained_request_is_a_501_naming_the_install(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry makes ``import xgrammar`` fail as it does where it is not installed.
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(NotInstalledError, match=re.escape(XGRAMMAR_INSTALL)) as raised:
        await run(engine, sampled({"regex": "[xy]{2}"}, n=1, seed=0))
    assert engine_exception_to_error(raised.value).status_code == 501


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "object"}, "whitespace": "loose"}, "whitespace"),
        ({"grammar": ""}, "non-empty"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"regex": "a", "pattern": "b"}, "unknown field"),
        ({"json": {"x": "y" * 70_000}}, "at most"),
    ],
)
def test_a_malformed_constraint_names_what_is_wrong(value: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_guided_decoding(value)


def test_a_schema_nested_too_deep_is_refused() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="levels deep"):
        parse_guided_decoding({"json": schema})
