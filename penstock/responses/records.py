"""What a stored response is, without a database (the routes and the serving layer import
this; SQLAlchemy is imported only where the store opens)."""

from __future__ import annotations

from typing import Any, NamedTuple


class StoredResponse(NamedTuple):
    """A response as returned, the input items it was given (each with an ``id``), and
    the conversation through its output as chat messages (without ``instructions``)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
