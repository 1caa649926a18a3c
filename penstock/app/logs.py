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
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if access is not None:
            line.update(access)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


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
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
        return self.default_msec_format % (self._second_text, record.msecs)


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
    access_logger.info(
        message,
        extra={
            "access": {
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": round(duration_ms, 3),
                "request_id": request_id,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
            }
        },
    )
