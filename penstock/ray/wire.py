"""What crosses from a replica to the ingress besides chunks: answers and errors.

A :class:`~penstock.errors.PenstockError` does not keep its status, param and code
across processes, so a replica sends it encoded (:func:`encode_error`) and the ingress
raises it again (:func:`decode_error`) with the same class, status, param and code:

* in a stream, as the last entry of a chunk batch (:func:`error_entry`), as in a LoRA
  adapter load's answer;
* in a fleet admin call, each replica's answer is :func:`ok_answer` (its name, ``ok``
  and the operation's fields) or :func:`failed_answer` (its name and the encoded error).

Both ends import this module and nothing else of each other.
"""

from __future__ import annotations

from typing import Any

from penstock import errors
from penstock.errors import PenstockError

# Pausing in place freezes in-flight requests and holds new ones: nothing is lost. The
# ingress asks it of every replica a weight update begins on; a replica replaying the
# fleet's last update on itself pauses the same way.
TRANSACTION_PAUSE_MODE = "keep"


def encode_error(error: PenstockError) -> dict[str, Any]:
    return {
        "class": type(error).__name__,
        "status": error.status_code,
        "message": error.message,
        "param": error.param,
        "code": error.code,
    }


def decode_error(encoded: dict[str, Any]) -> PenstockError:
    """The :class:`PenstockError` a replica reported, with its status, code and param."""
    cls = getattr(errors, str(encoded.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, PenstockError)):
        cls = PenstockError
    message, code = str(encoded.get("message")), encoded.get("code")
    try:
        error = cls(message, param=encoded.get("param"), code=code)
    except TypeError:
        error = PenstockError(message, code=code)
    error.status_code = int(encoded.get("status") or 500)
    return error


def error_entry(error: PenstockError) -> dict[str, Any]:
    """A stream's last batch entry, or an adapter load's answer, carrying ``error``."""
    return {"error": encode_error(error)}


def entry_error(entry: dict[str, Any]) -> PenstockError | None:
    """The error an :func:`error_entry` carries; ``None`` for any other entry (a chunk)."""
    if len(entry) == 1 and "error" in entry:
        return decode_error(entry["error"])
    return None


def ok_answer(replica: str, **fields: Any) -> dict[str, Any]:
    return {"replica": replica, "ok": True, **fields}


def failed_answer(replica: str, error: PenstockError) -> dict[str, Any]:
    return {"replica": replica, "ok": False, "error": encode_error(error)}


def answer_error(answer: dict[str, Any]) -> PenstockError:
    """The error of a :func:`failed_answer`."""
    return decode_error(answer["error"])
