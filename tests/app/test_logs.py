"""Log lines: the text format's time, and access lines written without the logging
machinery, are what logging itself writes."""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from penstock.app import logs
from penstock.app.logs import TEXT_FORMAT, TextFormatter, configure_logging, log_access


def record_at(created: float) -> logging.LogRecord:
    record = logging.LogRecord("penstock.access", logging.INFO, __file__, 1, "GET %s", ("/",), None)
    record.created = created
    record.msecs = (created - int(created)) * 1000
    return record


def test_text_lines_match_loggings_formatter_across_seconds() -> None:
    ours, logging_own = TextFormatter(), logging.Formatter(TEXT_FORMAT)
    # Within one second, into the next, a day later, and back: each line as logging writes it.
    for created in [1_700_000_000.001, 1_700_000_000.999, 1_700_000_001.5, 1_700_086_401.25]:
        record = record_at(created)
        assert ours.format(record) == logging_own.format(record_at(created))
    back = record_at(1_700_000_000.5)
    assert ours.format(back) == logging_own.format(record_at(1_700_000_000.5))


def test_an_explicit_date_format_is_honoured() -> None:
    record = record_at(1_700_000_000.5)
    assert TextFormatter().formatTime(record, "%Y") == logging.Formatter().formatTime(record, "%Y")


CREATED = 1_700_000_123.4567
LINE_FIELDS: dict[str, Any] = {
    "method": "POST",
    "route": "/v1/chat/completions",
    "status": 200,
    "duration_ms": 3.61234,
    "request_id": "req-7",
    "usage": {"prompt_tokens": 20, "completion_tokens": 5},
}


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], io.StringIO]]:
    """``configure_logging`` writing to a string, at a fixed time; undone afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logs._access_lines.handler)
    monkeypatch.setattr(time, "time", lambda: CREATED)
    # Where a record factory takes the time from (Ray's, once Ray is imported).
    monkeypatch.setattr(time, "time_ns", lambda: int(CREATED * 1e9))

    def configure(log_format: str) -> io.StringIO:
        stream = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        # As at a server's start: nothing configured yet (pytest's own handlers set aside).
        root.handlers.clear()
        configure_logging("info", log_format)
        return stream

    yield configure
    logging.captureWarnings(False)
    root.handlers[:], root.level, logs._access_lines.handler = saved


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_an_access_line_written_directly_is_the_line_logging_writes(
    configured: Callable[[str], io.StringIO], log_format: str
) -> None:
    stream = configured(log_format)
    log_access(**LINE_FIELDS)
    direct = stream.getvalue()
    # A filter anywhere on the way sends the record through logging.
    pass_all = logging.Filter()
    logs.access_logger.addFilter(pass_all)
    try:
        log_access(**LINE_FIELDS)
    finally:
        logs.access_logger.removeFilter(pass_all)
    assert stream.getvalue() == direct * 2
    assert "request_id=req-7 tokens_in=20 tokens_out=5" in direct


def test_another_handler_gets_the_access_lines_too(
    configured: Callable[[str], io.StringIO],
) -> None:
    stream = configured("text")
    seen: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = seen.append  # type: ignore[method-assign]
    logging.getLogger("penstock").addHandler(collector)
    try:
        log_access(**LINE_FIELDS)
    finally:
        logging.getLogger("penstock").removeHandler(collector)
    assert [record.access["request_id"] for record in seen] == ["req-7"]  # type: ignore[attr-defined]
    assert "request_id=req-7" in stream.getvalue()


def test_a_quieter_handler_gets_no_access_lines(
    configured: Callable[[str], io.StringIO],
) -> None:
    stream = configured("text")
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    log_access(**LINE_FIELDS)
    assert stream.getvalue() == ""
