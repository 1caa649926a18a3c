"""The engine controls: their names, their bodies, their refusal and their answers.

Every engine that offers a control offers it with the body and the answer defined here,
and the admin plane (:mod:`penstock.rl`) checks a trainer's fields with the same parsers,
so a field an engine would refuse is refused before it gets there, with the same reason.

Vocabulary: pause and sleep take a ``mode`` of :data:`PAUSE_MODES` (``abort`` ends the
requests in flight with ``finish_reason`` ``"abort"``, ``wait`` lets them finish,
``keep`` freezes them in place); sleep and wake take ``tags`` of :data:`SLEEP_TAGS`, a
sleep ``level`` of :data:`SLEEP_LEVELS` choosing the default tags (level 0 the KV cache
only, higher levels the weights too), a wake without tags waking everything.

Bodies (``parse_*``) and answers (one function per control):

* ``pause_generation {mode="abort", clear_cache=false}`` -> :func:`paused`;
* ``resume_generation {}`` -> :func:`resumed`; ``is_paused`` -> ``{"is_paused"}``;
* ``sleep {level=1, mode="abort", tags?}`` -> :func:`sleeping`; ``is_sleeping`` ->
  ``{"is_sleeping", "tags"}``;
* ``wake_up {tags?}`` -> :func:`woke` (``awake``, or ``partially_awake`` with the tags
  still released);
* ``abort_request {request_id | request_ids | abort_all}`` -> :func:`aborted` (the ids it
  ended, which then finish with ``finish_reason`` ``"abort"`` and what they had produced);
* ``flush_cache {}`` -> :func:`flushed`;
* ``weights_checksum {names?}``, ``get_weights_by_name {name, truncate_size=100}`` (the
  tensor's first ``truncate_size`` rows, as SGLang slices it) and ``reset_weights {}``
  (every weight tensor overwritten with random values, SGLang's ``reset_tensors``).

A body the engine refuses raises :class:`ControlRejected`; :func:`dispatch` turns it into
the one refusal answer, ``{"status": "error", "message"}``, which the admin plane answers
with a 400 naming the reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Body = dict[str, Any]
Handler = Callable[[Body], Awaitable[Body]]

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("kv_cache", "weights")
SLEEP_LEVELS = (0, 1, 2)
DEFAULT_TRUNCATE_SIZE = 100

PAUSE = "pause_generation"
RESUME = "resume_generation"
IS_PAUSED = "is_paused"
SLEEP = "sleep"
WAKE_UP = "wake_up"
IS_SLEEPING = "is_sleeping"
ABORT_REQUEST = "abort_request"
FLUSH_CACHE = "flush_cache"
GET_WEIGHT_VERSION = "get_weight_version"
WEIGHTS_CHECKSUM = "weights_checksum"
GET_WEIGHTS_BY_NAME = "get_weights_by_name"
RESET_WEIGHTS = "reset_weights"
CONTROL_NAMES = frozenset(
    {
        PAUSE,
        RESUME,
        IS_PAUSED,
        SLEEP,
        WAKE_UP,
        IS_SLEEPING,
        ABORT_REQUEST,
        FLUSH_CACHE,
        GET_WEIGHT_VERSION,
        WEIGHTS_CHECKSUM,
        GET_WEIGHTS_BY_NAME,
        RESET_WEIGHTS,
    }
)


class ControlRejected(ValueError):
    """A control or update body the engine refuses; ``field`` names the field at fault."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _invalid(field: str, reason: str) -> ControlRejected:
    return ControlRejected(f"'{field}' {reason}", field=field)


@dataclass(frozen=True)
class Pause:
    mode: str
    clear_cache: bool


@dataclass(frozen=True)
class Sleep:
    level: int
    mode: str
    tags: frozenset[str]


@dataclass(frozen=True)
class Wake:
    tags: frozenset[str]


@dataclass(frozen=True)
class Abort:
    """Which requests to end: ``request_ids``, or every one when it is None."""

    request_ids: frozenset[str] | None

    def matches(self, request_id: str) -> bool:
        return self.request_ids is None or request_id in self.request_ids


@dataclass(frozen=True)
class WeightsByName:
    name: str
    truncate_size: int


def default_sleep_tags(level: int) -> frozenset[str]:
    """Level 0 only drops the KV cache; higher levels release the weights too."""
    return frozenset({"kv_cache"}) if level == 0 else frozenset(SLEEP_TAGS)


def parse_mode(value: Any, field: str = "mode", default: str = "abort") -> str:
    if value is None:
        return default
    if value not in PAUSE_MODES:
        raise _invalid(field, f"must be one of {', '.join(PAUSE_MODES)}; got {value!r}")
    return str(value)


def parse_bool(value: Any, field: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(field, "must be a boolean")
    return value


def parse_level(value: Any, field: str = "level", default: int = 1) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(field, "must be an integer")
    if value not in SLEEP_LEVELS:
        raise _invalid(field, f"must be between {SLEEP_LEVELS[0]} and {SLEEP_LEVELS[-1]}")
    return value


def parse_tags(value: Any, field: str = "tags") -> frozenset[str] | None:
    """The tags named, or None when the body names none."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(tag, str) and tag for tag in value):
        raise _invalid(field, "must be a list of non-empty strings")
    unknown = sorted(set(value) - set(SLEEP_TAGS))
    if unknown:
        raise _invalid(
            field, f"has unknown tag(s) {', '.join(unknown)}; known: {', '.join(SLEEP_TAGS)}"
        )
    return frozenset(value)


def parse_pause(body: Body) -> Pause:
    return Pause(
        parse_mode(body.get("mode")), parse_bool(body.get("clear_cache"), "clear_cache", False)
    )


def parse_sleep(body: Body) -> Sleep:
    level = parse_level(body.get("level"))
    tags = parse_tags(body.get("tags"))
    return Sleep(level, parse_mode(body.get("mode")), tags or default_sleep_tags(level))


def parse_wake(body: Body) -> Wake:
    tags = parse_tags(body.get("tags"))
    return Wake(frozenset(SLEEP_TAGS) if tags is None else tags)


def parse_abort(body: Body) -> Abort:
    if parse_bool(body.get("abort_all"), "abort_all", False):
        return Abort(None)
    ids = body.get("request_ids")
    if ids is None and body.get("request_id") is not None:
        ids = [body["request_id"]]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
        raise ControlRejected(
            "Missing 'request_id' in body (a string; or 'request_ids', a list; or "
            "'abort_all': true)",
            field="request_id",
        )
    return Abort(frozenset(ids))


def parse_weights_by_name(body: Body) -> WeightsByName:
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid("name", "must be a non-empty string")
    truncate = body.get("truncate_size", DEFAULT_TRUNCATE_SIZE)
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
        raise _invalid("truncate_size", f"must be an integer >= 1; got {truncate!r}")
    return WeightsByName(name, truncate)


def parse_tensor_names(body: Body) -> list[str] | None:
    """``weights_checksum``'s ``names``: the tensors to sum, None for all of them."""
    names = body.get("names")
    if names is not None and (
        not isinstance(names, list) or not all(isinstance(n, str) for n in names)
    ):
        raise _invalid("names", "must be a list of tensor names")
    return names


def paused(mode: str, aborted_ids: Iterable[str]) -> Body:
    return {"status": "paused", "mode": mode, "aborted": sorted(aborted_ids)}


def resumed(still_sleeping: bool) -> Body:
    answer: Body = {"status": "resumed"}
    if still_sleeping:
        answer["is_sleeping"] = True
    return answer


def sleeping(level: int, tags: Iterable[str], aborted_ids: Iterable[str]) -> Body:
    return {
        "status": "sleeping",
        "is_sleeping": True,
        "level": level,
        "tags": sorted(tags),
        "aborted": sorted(aborted_ids),
    }


def woke(still_released: Iterable[str]) -> Body:
    remaining = sorted(still_released)
    if remaining:
        return {"status": "partially_awake", "is_sleeping": True, "tags": remaining}
    return {"status": "awake", "is_sleeping": False}


def pause_state(is_paused: bool) -> Body:
    return {"is_paused": is_paused}


def sleep_state(released: Iterable[str]) -> Body:
    tags = sorted(released)
    return {"is_sleeping": bool(tags), "tags": tags}


def aborted(ids: Iterable[str]) -> Body:
    return {"status": "ok", "aborted": sorted(ids)}


def flushed(entries: int | None = None) -> Body:
    return {"status": "ok", "message": "Cache flushed", "flushed_entries": entries}


def rejection(message: str) -> Body:
    return {"status": "error", "message": message}


Around = Callable[[str, Handler, Body], Awaitable[Body]]


async def dispatch(
    kind: str,
    handlers: Mapping[str, Handler],
    name: str,
    body: Any,
    *,
    around: Around | None = None,
) -> Body:
    """Run ``handlers[name]`` on ``body``; ``around`` wraps the call (a lock, a guard).

    An unknown name, a body that is not an object and a :class:`ControlRejected` come back
    as :func:`rejection`; anything else the handler raises propagates.
    """
    handler = handlers.get(name)
    if handler is None:
        return rejection(f"unsupported engine {kind}: {name}")
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return rejection("request body must be a JSON object")
    try:
        if around is None:
            return await handler(body)
        return await around(name, handler, body)
    except ControlRejected as exc:
        return rejection(str(exc))


class ControlTable:
    """``supported_*`` and ``engine_control`` / ``engine_update`` of an engine, from the two
    handler tables it returns; mixed in before the engine's contract base class."""

    def control_handlers(self) -> dict[str, Handler]:
        return {}

    def update_handlers(self) -> dict[str, Handler]:
        return {}

    async def around_handler(self, name: str, handler: Handler, body: Body) -> Body:
        """Where an engine wraps every control and update (default: runs it)."""
        return await handler(body)

    def supported_controls(self) -> set[str]:
        return set(self.control_handlers())

    def supported_updates(self) -> set[str]:
        return set(self.update_handlers())

    async def engine_control(self, control: str, body: Body) -> Body:
        return await dispatch(
            "control", self.control_handlers(), control, body, around=self.around_handler
        )

    async def engine_update(self, update: str, body: Body) -> Body:
        return await dispatch(
            "update", self.update_handlers(), update, body, around=self.around_handler
        )
