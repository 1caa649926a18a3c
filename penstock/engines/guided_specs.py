"""An engine request's ``sampling_options.guided_decoding``, checked and held to the
limits every constraint shares, without importing an engine.

The gateway checks each request's constraint here before it renders a prompt or sends
anything to an engine, and an engine that constrains output checks what it receives
(another front door may have built the request). The checks cost no more for an enormous
value than for one at the limit: sizes are bounded before anything walks or copies a
value whole.

The request names exactly one constraint: ``json`` (a JSON schema, or
``{"type": "object"}`` for any object), ``regex``, ``choice`` (a list of strings),
``grammar`` (EBNF in xgrammar's dialect) or ``structural_tag`` (xgrammar's structural
tag, as a dict or its JSON text); ``whitespace`` is ``"compact"`` (the default) or
``"any"``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# What a schema may weigh before compiling is refused: its JSON text, and its nesting.
MAX_SPEC_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
# A structural tag nests its own formats around the schemas it holds, each held to
# MAX_SCHEMA_DEPTH.
MAX_TAG_DEPTH = 2 * MAX_SCHEMA_DEPTH

_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")
_WHITESPACE = ("compact", "any")
# The fewest characters :func:`_check_bounded` counts for an object's member and for an
# array's item.
_MEMBER_CHARS = 4
_ITEM_CHARS = 1


@dataclass(frozen=True)
class GuidedSpec:
    """One request's constraint, validated: its kind, its text, and the whitespace rule."""

    kind: str
    text: str
    any_whitespace: bool


def parse_guided_decoding(value: Any) -> GuidedSpec | None:
    """``sampling_options.guided_decoding`` as a :class:`GuidedSpec`; ``ValueError``
    names the field and the reason."""
    where = "sampling_options.guided_decoding"
    if value in (None, {}):
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(value) - {*_KINDS, "whitespace", "backend"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kinds = [kind for kind in _KINDS if value.get(kind) is not None]
    if len(kinds) != 1:
        raise ValueError(f"{where} must name exactly one of {', '.join(_KINDS)}")
    whitespace = value.get("whitespace", "compact")
    if whitespace not in _WHITESPACE:
        raise ValueError(f"{where}.whitespace must be 'compact' or 'any', got {whitespace!r}")
    kind = kinds[0]
    text = _spec_text(kind, value[kind], f"{where}.{kind}")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{where}.{kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}")
    return GuidedSpec(kind, text, whitespace == "any")


def _spec_text(kind: str, value: Any, where: str) -> str:
    if kind in ("json", "structural_tag"):
        return _structured_text(kind, value, where)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where} must be a non-empty list of strings")
        # Each choice is at least one character and a separator.
        _check_chars(2 * len(value) - 1, where)
        if not all(isinstance(choice, str) for choice in value):
            raise ValueError(f"{where} must be a non-empty list of strings")
        if any(not choice for choice in value):
            raise ValueError(f"{where}: every choice must be a non-empty string")
        return "|".join(re.escape(choice) for choice in value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string")
    return value


def _structured_text(kind: str, value: Any, where: str) -> str:
    """A JSON schema or a structural tag (an object or its JSON text) as compact text,
    its size and nesting checked before anything walks all of it."""
    if isinstance(value, str):
        _check_chars(len(value), where)
        try:
            value = json.loads(value)
        except RecursionError as exc:
            raise ValueError(f"{where} nests too deep; at most {MAX_SCHEMA_DEPTH} levels") from exc
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        noun = "a JSON schema object" if kind == "json" else "an object or its JSON text"
        raise ValueError(f"{where} must be {noun}")
    if kind == "json":
        _check_bounded(value, where, MAX_SCHEMA_DEPTH)
    else:
        _check_bounded(value, where, MAX_TAG_DEPTH)
        for path, schema in _tag_schemas(value):
            _check_bounded(schema, f"{where}{path}", MAX_SCHEMA_DEPTH)
    # In the schema's own order: xgrammar's strict mode writes properties in it.
    return json.dumps(value)


def _check_chars(chars: int, where: str) -> None:
    if chars > MAX_SPEC_CHARS:
        raise ValueError(f"{where} is over {MAX_SPEC_CHARS} characters; at most {MAX_SPEC_CHARS}")


def _check_bounded(value: Any, where: str, max_depth: int) -> None:
    """``ValueError`` when ``value`` nests deeper than ``max_depth`` or its JSON text
    would exceed :data:`MAX_SPEC_CHARS`. A container's least size is counted before its
    members are, so the walk visits at most as many values as text at the limit holds,
    however many ``value`` has. Iterative: no recursion."""
    chars, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        # Every value is at least one character, with its separator.
        chars += 1 + (len(item) if isinstance(item, str) else 0)
        if isinstance(item, dict | list):
            if level > max_depth:
                raise ValueError(f"{where} nests over {max_depth} levels deep; at most {max_depth}")
            least = (_MEMBER_CHARS if isinstance(item, dict) else _ITEM_CHARS) * len(item)
            _check_chars(chars + least, where)
            if isinstance(item, dict):
                chars += sum(len(key) + 3 for key in item)
                stack.extend((child, level + 1) for child in item.values())
            else:
                stack.extend((child, level + 1) for child in item)
        _check_chars(chars, where)


def _tag_schemas(tag: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every JSON schema a structural tag holds, with its path: xgrammar's
    ``json_schema`` formats and the ``schema`` of vLLM's ``structures``."""
    found: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", tag)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "json_schema" or (key == "schema" and "begin" in item):
                    found.append((f"{path}.{key}", child))
                else:
                    stack.append((f"{path}.{key}", child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return found
