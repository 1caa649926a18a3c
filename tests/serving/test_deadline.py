"""The deadline's arithmetic and its cancellation rules, without a server."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from penstock.errors import InvalidRequestError, RequestTimeoutError
from penstock.serving.deadline import Deadline, requested_timeout
from penstock.settings import Settings


def request_with(timeout: str | None) -> Request:
    headers = [] if timeout is None else [(b"x-request-timeout", timeout.encode())]
    return Request({"type": "http", "headers": headers})


@pytest.mark.parametrize(
    ("header", "default", "cap", "expected"),
    [
        (None, None, None, None),
        (None, 30.0, None, 30.0),
        ("2.5", 30.0, None, 2.5),
        ("2.5", None, 1.0, 1.0),
        ("600", 30.0, 60.0, 60.0),
    ],
)
def test_the_header_wins_over_the_default_and_is_capped(
    header: str | None, default: float | None, cap: float | None, expected: float | None
) -> None:
    settings = Settings(request_timeout_s=default, max_request_timeout_s=cap)
    assert requested_timeout(request_with(header), settings) == expected


@pytest.mark.parametrize("header", ["", "soon", "0", "-3", "nan", "inf", "1e999"])
def test_a_header_that_is_no_positive_finite_number_is_refused(header: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        requested_timeout(request_with(header), Settings())
    assert caught.value.param == "X-Request-Timeout"


def test_the_default_may_not_exceed_the_maximum() -> None:
    with pytest.raises(ValidationError, match="must not exceed"):
        Settings(request_timeout_s=120, max_request_timeout_s=60)


def test_expiry_during_a_wait_raises_the_timeout_and_leaves_the_task_uncancelled() -> None:
    async def scenario() -> None:
        deadline = Deadline(0.05)
        with pytest.raises(RequestTimeoutError):
            await deadline.within(asyncio.sleep(10))
        assert deadline.expired
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        with pytest.raises(RequestTimeoutError):
            await deadline.within(asyncio.sleep(0))

    asyncio.run(scenario())


def test_expiry_between_waits_is_noticed_at_the_next_one() -> None:
    async def scenario() -> None:
        deadline = Deadline(0.05)
        await deadline.within(asyncio.sleep(0))
        await asyncio.sleep(0.1)  # not a wait on the engine: not interrupted
        assert deadline.expired
        with pytest.raises(RequestTimeoutError):
            await deadline.within(asyncio.sleep(0))

    asyncio.run(scenario())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def scenario() -> None:
        deadline = Deadline(10)
        task = asyncio.ensure_future(deadline.within(asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not deadline.expired

    asyncio.run(scenario())
