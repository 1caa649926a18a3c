"""Rendering a model's Jinja chat template the way transformers does, inside a sandbox.

Chat templates come with model folders and are untrusted code, so they run in jinja2's
immutable sandbox.

Message content reaches a template as one string, except in the messages that carry
media parts when the template loops over ``message['content']`` (HF vision-language
templates do): those get the parts themselves, text parts as sent and media parts as
``{"type": "image"}`` / ``{"type": "audio"}``, so the template writes the model's own
placeholder where each item sits. Templates that only print content get the text parts
joined, media left out. The environment mirrors ``transformers``' (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``, a non-escaping
``tojson``, a no-op ``{% generation %}`` block) so Hub templates render identically.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from penstock.errors import InvalidRequestError
from penstock.preprocess.tokenizer_files import DEFAULT_TEMPLATE_NAME

TOOL_USE_TEMPLATE_NAME = "tool_use"

# Names the renderer itself passes; a chat_template_kwargs entry must not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks.

    Serving needs only the text, so the block renders its body unchanged; without this
    extension such templates would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, which would reach object internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja's Namespace takes self positionally so that `namespace(self=...)` works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes ({name!r}) on a namespace"
        )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _build_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _TemplateNamespace
    return environment


_ENVIRONMENT = _build_environment()


def compile_template(source: str) -> jinja2.Template:
    """Compile once at load; raises ``jinja2.TemplateSyntaxError`` for a broken template."""
    template = _ENVIRONMENT.from_string(source)
    # Each render copies the globals into a fresh context: from a plain dict that costs a
    # third of what it costs from jinja's ChainMap over the environment's (~15 -> ~5 us).
    template.globals = dict(template.globals)
    return template


def iterates_content(source: str) -> bool:
    """Whether the template loops over a message's ``content`` (as a list of parts)."""
    try:
        tree = _ENVIRONMENT.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    return any(_is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node) -> bool:
    # `message['content'] | selectattr(...)` loops over content too.
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


def render_template(
    template: jinja2.Template,
    *,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    special_tokens: dict[str, str],
    chat_template_kwargs: dict[str, Any] | None,
    content_parts: bool = False,
) -> str:
    """``content_parts``: the template loops over content (see :func:`iterates_content`)."""
    variables: dict[str, Any] = dict(special_tokens)
    if chat_template_kwargs:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(chat_template_kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                "the request's own fields supply them",
                param="chat_template_kwargs",
            )
        variables.update(chat_template_kwargs)
    variables["messages"] = [
        _template_message(message, index, content_parts) for index, message in enumerate(messages)
    ]
    variables["tools"] = tools
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return template.render(variables)
    except Exception as exc:
        # The template is model-supplied code running on request data: whatever it raises
        # (raise_exception, a sandbox refusal, a type error on odd content) is a reason
        # this request cannot be rendered, not a server fault.
        raise InvalidRequestError(
            f"The chat template could not render these messages: {_describe(exc)}",
            param="messages",
        ) from exc


def _describe(exc: Exception) -> str:
    text = str(exc)
    return text if text else type(exc).__name__


def _template_message(message: dict[str, Any], index: int, content_parts: bool) -> dict[str, Any]:
    """The message as templates expect it: content as one string, tool arguments as objects."""
    if not isinstance(message, dict):
        raise InvalidRequestError(
            f"messages[{index}] must be an object, not {type(message).__name__}",
            param=f"messages[{index}]",
        )
    rendered = dict(message)
    content = message.get("content")
    parts = _media_parts(content) if content_parts else None
    rendered["content"] = parts if parts is not None else _text_content(content)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        rendered["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return rendered


# OpenAI media part types as HF templates name them.
_MEDIA_PART_TYPES = {
    "image_url": "image",
    "image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio": "audio",
}


def _media_parts(content: Any) -> list[dict[str, Any]] | None:
    """Content with media as HF-style parts; None when it is text only."""
    if not isinstance(content, list):
        return None
    parts = [part for part in content if isinstance(part, dict)]
    if not any(part.get("type") in _MEDIA_PART_TYPES for part in parts):
        return None
    shaped: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        if kind == "text" and "text" in part:
            shaped.append({"type": "text", "text": part["text"]})
        elif kind in _MEDIA_PART_TYPES:
            shaped.append({"type": _MEDIA_PART_TYPES[kind]})
    return shaped


def _text_content(content: Any) -> Any:
    """Join text parts; media parts are handled by the router, not rendered as text.

    Parts are joined with a newline, as vLLM does for string-content templates.
    """
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and "text" in part
        )
    return content


def _template_tool_call(call: Any) -> Any:
    """OpenAI sends ``function.arguments`` as a JSON string; templates iterate it as a dict."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = _parse_json_object(function["arguments"])
    if arguments is None:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _parse_json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def select_template_name(
    templates: dict[str, Any], tools: list[dict[str, Any]] | None
) -> str | None:
    """transformers' rule: a ``tool_use`` template for requests with tools, else the default."""
    if tools and TOOL_USE_TEMPLATE_NAME in templates:
        return TOOL_USE_TEMPLATE_NAME
    if DEFAULT_TEMPLATE_NAME in templates:
        return DEFAULT_TEMPLATE_NAME
    return None
