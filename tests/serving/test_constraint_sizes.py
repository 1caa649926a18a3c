"""A body's constraint field too large to be within the limit is refused from its raw
text, in every top-level spelling; a large body whose constraint is small is not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from penstock.errors import InvalidRequestError
from penstock.serving.guided import MAX_RAW_CONSTRAINT_BYTES, refuse_oversized_constraints

WIDE = {"type": "object", "properties": {f"p{i}": {} for i in range(200_000)}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [], **fields}).encode()


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": WIDE},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE}}},
        {"structured_outputs": {"json": json.dumps(WIDE)}},
        {"guided_choice": [f"c{i}" for i in range(300_000)]},
    ],
    ids=["guided_json", "response_format", "structured_outputs-text", "guided_choice"],
)
def test_an_oversized_constraint_field_is_refused_naming_the_limit(fields: dict[str, Any]) -> None:
    raw = body(**fields)
    assert len(raw) > MAX_RAW_CONSTRAINT_BYTES
    with pytest.raises(InvalidRequestError, match="at most 65536") as refused:
        refuse_oversized_constraints(raw)
    assert refused.value.param == next(iter(fields))


def test_a_large_body_with_a_small_constraint_passes() -> None:
    raw = body(prompt="x" * (2 * MAX_RAW_CONSTRAINT_BYTES), guided_json={"type": "object"})
    refuse_oversized_constraints(raw)


@pytest.mark.parametrize("raw", [b"[1, 2]" * 400_000, b"{" * (MAX_RAW_CONSTRAINT_BYTES + 1)])
def test_a_body_that_is_not_an_object_is_left_to_the_parser(raw: bytes) -> None:
    refuse_oversized_constraints(raw)
