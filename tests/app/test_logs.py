"""Log lines: the text format's time is what logging's own formatter writes."""

from __future__ import annotations

import logging

from penstock.app.logs import TEXT_FORMAT, TextFormatter


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
