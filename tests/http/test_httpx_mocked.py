"""HttpxClient against a mocked network (respx): library errors become unified ones, and
the limits hold for bodies a mock streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import respx

from penstock.errors import (
    HttpConnectionError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http import HttpConfigBase, UrlValidationPolicy
from penstock.http.httpx_client import HttpxClient

URL = "https://media.test/cat.png"
POLICY = UrlValidationPolicy()


class Chunks(httpx.AsyncByteStream):
    def __init__(self, count: int, delay: float = 0.0) -> None:
        self.count, self.delay, self.sent = count, delay, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            await asyncio.sleep(self.delay)
            self.sent += 1
            yield b"x" * 65536


@pytest.fixture
async def client() -> AsyncIterator[HttpxClient]:
    made = HttpxClient()
    yield made
    await made.close()


@respx.mock
async def test_bodies_and_statuses(client: HttpxClient) -> None:
    respx.get(URL).respond(200, content=b"png bytes")
    respx.get("https://media.test/missing").respond(404, text="nope" * 5000)
    respx.get("https://media.test/broken").respond(503)
    assert await client.fetch_bytes(URL, 5, policy=POLICY) == b"png bytes"
    with pytest.raises(HttpStatusError) as missing:
        await client.fetch_bytes("https://media.test/missing", 5, policy=POLICY)
    assert (missing.value.status, missing.value.status_code) == (404, 404)
    assert missing.value.envelope()["error"]["code"] == "media_fetch_failed"
    with pytest.raises(HttpStatusError) as broken:
        await client.fetch_bytes("https://media.test/broken", 5, policy=POLICY)
    assert (broken.value.status, broken.value.status_code) == (503, 502)


@pytest.mark.parametrize(
    ("raised", "unified"),
    [
        (httpx.ConnectTimeout("t"), HttpTimeoutError),
        (httpx.ReadTimeout("t"), HttpTimeoutError),
        (httpx.PoolTimeout("t"), HttpTimeoutError),
        (httpx.ConnectError("refused"), HttpConnectionError),
        (httpx.ReadError("reset"), HttpConnectionError),
        (httpx.RemoteProtocolError("half-closed"), HttpConnectionError),
    ],
)
@respx.mock
async def test_library_errors_never_escape(
    client: HttpxClient, raised: Exception, unified: type[Exception]
) -> None:
    respx.get(URL).mock(side_effect=raised)
    with pytest.raises(unified) as failed:
        await client.fetch_bytes(URL, 5, policy=POLICY)
    assert not isinstance(failed.value, httpx.HTTPError)


@respx.mock
async def test_a_redirect_to_a_blocked_host_is_never_requested(client: HttpxClient) -> None:
    respx.get(URL).respond(302, headers={"Location": "http://169.254.169.254/latest/"})
    metadata = respx.get("http://169.254.169.254/latest/").respond(200)
    with pytest.raises(UrlValidationError):
        await client.fetch_bytes(URL, 5, policy=UrlValidationPolicy(allow_http=True))
    assert not metadata.called


@respx.mock
async def test_oversize_and_slow_bodies_stop_while_streaming(client: HttpxClient) -> None:
    big = Chunks(1000)
    respx.get(URL).mock(return_value=httpx.Response(200, stream=big))
    with pytest.raises(UrlValidationError, match="download limit"):
        await client.fetch_bytes(URL, 5, policy=POLICY, max_bytes=200_000)
    assert big.sent < 10
    slow = Chunks(100, delay=0.2)
    respx.get("https://media.test/slow").mock(return_value=httpx.Response(200, stream=slow))
    started = time.monotonic()
    with pytest.raises(HttpTimeoutError):
        await client.fetch_bytes("https://media.test/slow", 1.0, policy=POLICY)
    assert time.monotonic() - started < 2 and slow.sent < 10


@respx.mock
async def test_the_operator_timeout_replaces_the_callers() -> None:
    respx.get(URL).mock(return_value=httpx.Response(200, stream=Chunks(100, delay=0.2)))
    client = HttpxClient(HttpConfigBase(timeout=0.3))
    started = time.monotonic()
    with pytest.raises(HttpTimeoutError, match=r"0\.3s"):
        await client.fetch_bytes(URL, 60, policy=POLICY)
    assert time.monotonic() - started < 1.5
    await client.close()


def test_an_upstream_message_stays_within_its_bound() -> None:
    for length in (8192, 8193, 100_000):
        error = HttpStatusError(502, "m" * length, "https://media.test/x.png")
        assert len(error.message) <= HttpStatusError._MESSAGE_LIMIT
    assert "(100000 chars)" in HttpStatusError(502, "m" * 100_000, "https://m.test").message
