"""What one engine request leaves in the frontend's metric families."""

from __future__ import annotations

import asyncio
import time

import pytest

from penstock.errors import InvalidRequestError, OverloadedError
from penstock.metrics.frontend import PREFIX, FrontendMetrics
from penstock.serving.deadline import Deadline
from penstock.serving.request_metrics import RequestRecorder, error_type

MODEL = {"model": "m"}


def value(families: FrontendMetrics, name: str, **labels: str) -> float | None:
    return families.registry.get_sample_value(f"{PREFIX}{name}", {**MODEL, **labels})


def test_a_streamed_request_is_counted_in_batches_and_once_at_its_end() -> None:
    families = FrontendMetrics()
    recorder = RequestRecorder(families, "m", 7)
    assert value(families, "active_requests") == 1
    assert value(families, "queued_requests") == 1
    recorder.first_token(time.perf_counter())
    assert value(families, "queued_requests") == 0
    assert value(families, "time_to_first_token_seconds_count") == 1
    assert value(families, "input_sequence_tokens_sum") == 7
    # 100 chunks of 2 tokens, as the stream's loop hands them over: 99 latencies between
    # them, flushed with the tokens counted so far, the rest at the end.
    itl = [0.001] * 95
    recorder.flush(itl, 192)
    assert itl == []
    assert value(families, "output_tokens_total") == 192
    assert value(families, "inter_token_latency_seconds_count") == 95
    recorder.succeeded()
    recorder.finish([0.001] * 4, 8, 200, "chat_completions", True)
    assert value(families, "output_tokens_total") == 200
    assert value(families, "inter_token_latency_seconds_count") == 99
    assert value(families, "output_sequence_tokens_sum") == 200
    assert value(families, "request_duration_seconds_count") == 1
    assert value(families, "active_requests") == 0
    done = {"endpoint": "chat_completions", "request_type": "stream"}
    assert value(families, "requests_total", **done, status="success", error_type="") == 1


def test_a_request_that_fails_before_its_first_token_leaves_the_queue() -> None:
    families = FrontendMetrics()
    recorder = RequestRecorder(families, "m", 7)
    recorder.failed(OverloadedError("busy"), None)
    recorder.finish([], 0, 0, "completions", False)
    assert value(families, "queued_requests") == 0
    assert value(families, "time_to_first_token_seconds_count") == 0
    done = {"endpoint": "completions", "request_type": "unary", "status": "error"}
    assert value(families, "requests_total", **done, error_type="overload") == 1


def test_a_request_never_told_how_it_ended_counts_as_an_internal_error() -> None:
    families = FrontendMetrics()
    RequestRecorder(families, "m", 7).finish([], 0, 0, "completions", False)
    done = {"endpoint": "completions", "request_type": "unary", "status": "error"}
    assert value(families, "requests_total", **done, error_type="internal") == 1


@pytest.mark.parametrize(
    ("exc", "expired", "label"),
    [
        (asyncio.CancelledError(), False, "cancelled"),
        (GeneratorExit(), False, "cancelled"),
        (asyncio.CancelledError(), True, "response_timeout"),
        (OverloadedError("busy"), False, "overload"),
        (InvalidRequestError("bad"), False, "validation"),
        (RuntimeError("boom"), False, "internal"),
    ],
)
async def test_error_types_are_dynamos_labels(
    exc: BaseException, expired: bool, label: str
) -> None:
    deadline = Deadline(60.0)
    deadline.expired = expired
    assert error_type(exc, deadline) == label
