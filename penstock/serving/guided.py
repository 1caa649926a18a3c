"""A request's output constraint, from whichever API spelling it used, as the engine's
``sampling_options.guided_decoding``.

Spellings: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``structural_tag``,
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (SGLang's ``sampling_params`` ``json_schema`` / ``regex`` / ``ebnf`` /
``structural_tag`` arrive as these: :mod:`penstock.serving.generate`), and a chat
request's ``tool_choice`` ``required`` or naming a function (:func:`tool_call_constraint`).
At most one may be sent; only an engine that advertises ``SUPPORTS_GUIDED_DECODING`` gets
one, every other engine's request is a 400 naming the field. Each is held to the limits
of :mod:`penstock.engines.guided_specs` here, before the request's prompt is rendered.

JSON comes out compact by default (``", "`` and ``": "``, no other whitespace): a weak
model given free whitespace pads until the token limit. vLLM's
``structured_outputs.disable_any_whitespace: false`` asks for any whitespace instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from penstock.engines.contract import SUPPORTS_GUIDED_DECODING
from penstock.engines.guided_specs import MAX_SPEC_CHARS, parse_guided_decoding
from penstock.errors import InvalidRequestError
from penstock.gateway import ServedModel
from penstock.schemas.openai import ChatCompletionRequest, SamplingFields, Tool
from penstock.serving.limits import engine_capability
from penstock.serving.parsing import check_named_tool
from penstock.serving.tool_grammars import ANY_JSON_OBJECT, forced_calls_tag

# Each kind of ``structured_outputs`` as the engine's kind.
_STRUCTURED_KINDS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}
# vLLM's older one-field spellings.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_BACKENDS = (None, "", "auto", "xgrammar")
# A request that sets none of these asks for no constraint.
_CONSTRAINT_FIELDS = frozenset(
    {"response_format", "guided_decoding_backend", "structured_outputs", *_GUIDED_FIELDS}
)


MAX_RAW_CONSTRAINT_BYTES = 16 * MAX_SPEC_CHARS
"""The most JSON text a constraint field may take in a body: room for pretty-printing a
constraint at the limit, and far below the body that costs seconds to parse."""


class _ConstraintFields(msgspec.Struct):
    """The top-level fields of a body that carry a constraint, as their JSON text."""

    response_format: msgspec.Raw = msgspec.Raw()
    structured_outputs: msgspec.Raw = msgspec.Raw()
    guided_json: msgspec.Raw = msgspec.Raw()
    guided_regex: msgspec.Raw = msgspec.Raw()
    guided_choice: msgspec.Raw = msgspec.Raw()
    guided_grammar: msgspec.Raw = msgspec.Raw()


# Skipping the other fields without building them: a 40 MB body of one image in
# ~11 ms, a third of what parsing it takes (bench/README.md).
_CONSTRAINT_FIELDS_TEXT = msgspec.json.Decoder(_ConstraintFields)


def refuse_oversized_constraints(body: bytes) -> None:
    """A 400 naming the limit when a request body's constraint field takes more than
    :data:`MAX_RAW_CONSTRAINT_BYTES` of its text: checked on the raw body, before it is
    parsed, since parsing a schema of a million properties into Python values holds the
    event loop for seconds."""
    if len(body) <= MAX_RAW_CONSTRAINT_BYTES:
        return
    try:
        fields = _CONSTRAINT_FIELDS_TEXT.decode(body)
    except msgspec.DecodeError:
        # Not an object of fields: the body's parser says what is wrong with it.
        return
    for field in _ConstraintFields.__struct_fields__:
        text = getattr(fields, field)
        if len(text) > MAX_RAW_CONSTRAINT_BYTES:
            raise InvalidRequestError(
                f"{field} is {len(text)} bytes of JSON; an output constraint may be at most "
                f"{MAX_SPEC_CHARS} characters of compact JSON",
                param=field,
            )


def sampling_guided_decoding(body: SamplingFields, model: ServedModel) -> dict[str, Any] | None:
    """The constraint of a chat or completions request's vLLM and OpenAI fields."""
    if _CONSTRAINT_FIELDS.isdisjoint(body.__pydantic_fields_set__):
        return None
    found: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None:
        response_format = body.response_format
        if response_format.type == "json_object":
            found.append(("response_format", {"json": ANY_JSON_OBJECT}))
        elif response_format.type == "json_schema" and response_format.json_schema is not None:
            schema = response_format.json_schema.schema_
            found.append(("response_format", {"json": schema or ANY_JSON_OBJECT}))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    if body.guided_decoding_backend not in _BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {body.guided_decoding_backend!r} is not available; "
            "this server constrains with xgrammar",
            param="guided_decoding_backend",
        )
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    return _one(found, model, body.model)


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    kinds = [key for key in _STRUCTURED_KINDS if value.get(key) is not None]
    if value.get("json_object"):
        kinds.append("json_object")
    if len(kinds) != 1:
        raise InvalidRequestError(
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            f"structural_tag, json_object; got {', '.join(kinds) or 'none'}",
            param="structured_outputs",
        )
    kind = kinds[0]
    spec: dict[str, Any] = (
        {"json": ANY_JSON_OBJECT} if kind == "json_object" else {kind: value[kind]}
    )
    if value.get("disable_any_whitespace") is False:
        spec["whitespace"] = "any"
    return spec


def tool_call_constraint(
    body: ChatCompletionRequest, tool_call_parser: str | None
) -> tuple[str, dict[str, Any]] | None:
    """For ``tool_choice`` ``required`` or naming a function: the grammar of the calls,
    in the format the server's parser reads, the arguments held to each tool's schema
    (:mod:`penstock.serving.tool_grammars`)."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        check_named_tool(body, choice)
    elif choice != "required":
        return None
    if not body.tools:
        raise InvalidRequestError(
            f"tool_choice {_describe(choice)} needs tools", param="tool_choice"
        )
    if tool_call_parser is None:
        raise InvalidRequestError(
            f"tool_choice {_describe(choice)} needs the server started with --tool-call-parser",
            param="tool_choice",
        )
    tools: Sequence[Tool] = body.tools
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [tool for tool in body.tools if tool.function.name == name]
    parallel = body.parallel_tool_calls is not False and choice == "required"
    return "tool_choice", {
        "structural_tag": forced_calls_tag(tool_call_parser, tools, parallel=parallel)
    }


def _one(
    found: list[tuple[str, dict[str, Any]]], model: ServedModel, name: str
) -> dict[str, Any] | None:
    if not found:
        return None
    if len(found) > 1:
        fields = ", ".join(field for field, _ in found)
        raise InvalidRequestError(
            f"at most one output constraint may be sent; got {fields}", param=found[1][0]
        )
    field, spec = found[0]
    check_can_constrain(model, field, name)
    try:
        parse_guided_decoding(spec)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=field) from None
    return spec


def check_can_constrain(model: ServedModel, field: str, name: str) -> None:
    """400 naming ``field`` unless ``model``'s engine constrains its output."""
    if not engine_capability(model, SUPPORTS_GUIDED_DECODING):
        raise InvalidRequestError(
            f"{field} is not supported: the model '{name}' can't honour it "
            "(its engine does not constrain output)",
            param=field,
            code="unsupported_parameter",
        )


def combine(
    found: dict[str, Any] | None, tools: tuple[str, dict[str, Any]] | None, model: ServedModel
) -> dict[str, Any] | None:
    """The request's one constraint, its fields' and its tool choice's together."""
    if tools is None:
        return found
    if found is not None:
        raise InvalidRequestError(
            "tool_choice 'required' or naming a function constrains the answer to tool calls; "
            "it can't be sent with another output constraint",
            param="tool_choice",
        )
    return _one([tools], model, model.name)


def _describe(choice: object) -> str:
    return "naming a function" if isinstance(choice, dict) else repr(choice)
