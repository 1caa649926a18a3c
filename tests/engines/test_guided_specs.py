"""The constraint checks the gateway and the engines share cost no more for an enormous
value than for one at the limit: a container too large to fit is refused before its
members are visited."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from penstock.engines.guided_specs import MAX_SPEC_CHARS, parse_guided_decoding


class CountedProperties(dict[str, Any]):
    """Properties that count how many of their values are visited."""

    visited = 0

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        for value in super().values():
            CountedProperties.visited += 1
            yield value

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        for pair in super().items():
            CountedProperties.visited += 1
            yield pair


@pytest.mark.parametrize("spelling", ["json", "structural_tag"])
def test_a_schema_of_a_million_properties_is_refused_unvisited(spelling: str) -> None:
    CountedProperties.visited = 0
    properties = CountedProperties((f"p{i}", {}) for i in range(1_000_000))
    schema = {"type": "object", "properties": properties}
    if spelling == "json":
        value: dict[str, Any] = {"json": schema}
    else:
        tag = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}]}
        value = {"structural_tag": tag}
    with pytest.raises(ValueError, match=f"at most {MAX_SPEC_CHARS}"):
        parse_guided_decoding(value)
    assert CountedProperties.visited == 0


def test_a_choice_list_too_long_to_fit_is_refused_unvisited() -> None:
    class CountedChoices(list[Any]):
        visited = 0

        def __iter__(self) -> Iterator[Any]:
            for choice in super().__iter__():
                CountedChoices.visited += 1
                yield choice

    choices = CountedChoices(["a"] * MAX_SPEC_CHARS)
    with pytest.raises(ValueError, match=f"at most {MAX_SPEC_CHARS}"):
        parse_guided_decoding({"choice": choices})
    assert CountedChoices.visited == 0


def test_a_schema_at_the_limit_is_accepted() -> None:
    properties = {f"p{i:05}": {} for i in range(MAX_SPEC_CHARS // 20)}
    spec = parse_guided_decoding({"json": {"type": "object", "properties": properties}})
    assert spec is not None and len(spec.text) <= MAX_SPEC_CHARS
