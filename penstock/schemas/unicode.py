"""Request text must be valid Unicode.

JSON can escape half of a UTF-16 surrogate pair on its own (``"\\ud800"``) and Python's
JSON decoder accepts it, but such a string has no UTF-8 form: the tokenizer, the engine
and the JSON encoder of the response (or of an error that quotes it) all fail on it. So
request models refuse it where the string arrives, naming the field.

A body that pydantic-core's JSON parser read holds no such string (that parser refuses a
lone surrogate escape): validated with :data:`UNICODE_CHECKED` as its context, its strings
are not searched again, which for a schema of a million properties would take a second.
"""

from __future__ import annotations

from itertools import repeat
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


def _surrogate_in(text: str) -> str | None:
    if text.isascii():
        return None
    # Encoding is the fastest full scan CPython offers (a regex is several times slower);
    # the copy is short-lived.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return text[exc.start]
    return None


def _first_surrogate(value: Any) -> str | None:
    """The first unpaired surrogate in a string, or in any string or key of a JSON value.

    Validated models inside the value are skipped: their own fields were checked already.
    """
    kind = type(value)
    if kind is str:
        return _surrogate_in(value)
    if kind is not dict and kind is not list:
        return None
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is str:
            found = _surrogate_in(item)
            if found is not None:
                return found
        elif kind is dict:
            pending.extend(item)
            pending.extend(item.values())
        elif kind is list:
            pending.extend(item)
    return None


UNICODE_CHECKED = {"unicode_checked": True}
"""The validation context of a value whose strings are known to be valid Unicode."""


def _known_valid(info: ValidationInfo) -> bool:
    return info.context is UNICODE_CHECKED


def _json_value(value: Any, info: ValidationInfo) -> Any:
    return value if _known_valid(info) else valid_unicode(value)


def valid_unicode(value: Any) -> Any:
    """A pydantic validator: ``value`` unchanged, or an error naming the surrogate."""
    surrogate = _first_surrogate(value)
    if surrogate is not None:
        raise PydanticCustomError(
            "invalid_unicode",
            "text must be valid Unicode, but holds the unpaired surrogate {surrogate}",
            {"surrogate": f"U+{ord(surrogate):04X}"},
        )
    return value


JSONValue = Annotated[Any, AfterValidator(_json_value)]
"""Any JSON value whose strings and keys are valid Unicode (for ``__pydantic_extra__``)."""


class RequestModel(BaseModel):
    """Base of request models: every field's strings, at any depth, are valid Unicode.

    Nested models check their own fields (so the error names the innermost field); fields
    of ``Any`` or ``dict`` type are searched whole. Models that keep undeclared fields
    annotate ``__pydantic_extra__: dict[str, JSONValue]`` to have those checked too.
    """

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        # Every field a client sends passes here: an ASCII string, and a value that holds
        # no string (a number, a flag, a model), are answered without another call.
        if _known_valid(info):
            return value
        kind = type(value)
        if kind is str:
            if value.isascii():
                return value
        elif kind is list:
            # A list of validated models (a conversation): each checked its own fields.
            if all(map(isinstance, value, repeat(BaseModel))):
                return value
        elif kind is not dict:
            return value
        return valid_unicode(value)
