"""Process logging: text or JSON lines for every logger, and the per-request access line.

JSON lines always carry ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``;
access lines add ``method``, ``route``, ``status``, ``duration_ms``, ``request_id``,
``prompt_tokens`` and ``completion_tokens`` (null outside chat and completions); a record
logged with an exception adds ``exception``.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import orjson

ACCESS_LOGGER = "penstock.access"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_logger = logging.getLogger(ACCESS_LOGGER)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with fixed keys."""

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        line = self.line(record.created, record.levelname, record.name, record.getMessage(), access)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()

    def format_access(self, created: float, message: str, access: dict[str, Any]) -> str:
        """What :meth:`format` makes of an access line's record."""
        return orjson.dumps(self.line(created, "INFO", ACCESS_LOGGER, message, access)).decode()

    @staticmethod
    def line(
        created: float, level: str, name: str, message: str, access: dict[str, Any] | None
    ) -> dict[str, Any]:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds"),
            "level": level,
            "logger": name,
            "message": message,
        }
        if access is not None:
            line.update(access)
        return line


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, its time's text made once a second rather than once a line
    (``time.strftime`` is most of a line's formatting, and there is a line per request)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second = -1
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self._time_text(record.created, record.msecs)

    def format_access(self, created: float, message: str, access: dict[str, Any]) -> str:
        """What :meth:`format` makes of an access line's record."""
        return f"{self._time_text(created, _msecs(created))} INFO {ACCESS_LOGGER}: {message}"

    def _time_text(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
        return self.default_msec_format % (self._second_text, msecs)


def _msecs(created: float) -> float:
    """A record's ``msecs``, as ``logging.LogRecord`` computes it."""
    return int((created - int(created)) * 1000) + 0.0


class _AccessLines:
    """Where access lines go without a trip through the logging machinery (~15 µs of the
    ~35 a line cost in a server's request path): the one handler
    :func:`configure_logging` made, while nothing has been configured around it since."""

    handler: logging.StreamHandler[Any] | None = None

    def direct_handler(self) -> logging.StreamHandler[Any] | None:
        """That handler while a record of the access logger would reach it alone and
        unfiltered (no other handler, filter or propagation change on the way), else None."""
        handler = self.handler
        if handler is None or handler.filters or handler.level > logging.INFO:
            return None
        for logger in _ACCESS_LINE_PATH:
            if logger.filters or not logger.propagate or logger.disabled:
                return None
            if logger.handlers and logger is not _ROOT:
                return None
        if len(_ROOT.handlers) != 1 or _ROOT.handlers[0] is not handler:
            return None
        return handler


_ROOT = logging.getLogger()
# The loggers an access line's record passes, innermost first.
_ACCESS_LINE_PATH = (access_logger, logging.getLogger("penstock"), _ROOT)
_access_lines = _AccessLines()


def configure_logging(level: str, log_format: str) -> None:
    """Route every logger (uvicorn's and Python warnings included) through one root handler
    in ``log_format``, so a JSON log holds nothing but JSON lines."""
    logging.captureWarnings(True)
    # Neither format shows a record's thread, process or source line, so they are not
    # collected: the access line is one record per request, and this takes ~a fifth off
    # each (the knobs of the logging HOWTO's "Optimization" section).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    _access_lines.handler = handler


def log_access(
    *,
    method: str,
    route: str,
    status: int,
    duration_ms: float,
    request_id: str,
    usage: dict[str, Any] | None,
) -> None:
    """Write the access line of one finished request."""
    prompt = usage.get("prompt_tokens") if usage else None
    completion = usage.get("completion_tokens") if usage else None
    message = f"{method} {route} {status} {duration_ms:.1f}ms request_id={request_id}"
    if usage:
        message += f" tokens_in={prompt} tokens_out={completion}"
    access = {
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": round(duration_ms, 3),
        "request_id": request_id,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }
    handler = _access_lines.direct_handler()
    formatter = handler.formatter if handler is not None else None
    if not isinstance(formatter, TextFormatter | JsonFormatter):
        access_logger.info(message, extra={"access": access})
        return
    assert handler is not None
    # As ``StreamHandler.emit`` writes the record's line, under the handler's lock.
    line = formatter.format_access(time.time(), message, access)
    with handler.lock:  # type: ignore[union-attr]
        try:
            handler.stream.write(line + handler.terminator)
            handler.flush()
        except RecursionError:
            raise
        except Exception:
            record = access_logger.makeRecord(
                ACCESS_LOGGER, logging.INFO, "", 0, message, (), None, extra={"access": access}
            )
            handler.handleError(record)
