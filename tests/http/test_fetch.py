"""Both backends fetch through the same SSRF checks and give the same answers.

A loopback origin (tests/http/conftest.py) serves real sockets to both clients; the
loopback range is opened to them only through the operator's ``allowed_networks``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import quote

import pytest

from penstock.errors import (
    HttpConnectionError,
    HttpError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http import HttpClient, HttpConfigBase, UrlValidationPolicy
from penstock.http.aiohttp_client import AiohttpClient
from penstock.http.httpx_client import HttpxClient

LOOPBACK_OPEN = UrlValidationPolicy(allow_http=True, allowed_networks=("127.0.0.1/32",))
BACKENDS = {"httpx": HttpxClient, "aiohttp": AiohttpClient}


@pytest.fixture(params=sorted(BACKENDS))
async def client(request: pytest.FixtureRequest) -> AsyncIterator[HttpClient]:
    made = BACKENDS[request.param]()
    yield made
    await made.close()
    await made.close()


async def fetch(client: HttpClient, url: str, **kwargs: object) -> bytes:
    kwargs.setdefault("policy", LOOPBACK_OPEN)
    return await client.fetch_bytes(url, 5.0, **kwargs)  # type: ignore[arg-type]


async def test_fetches_an_allowed_origin(client: HttpClient, origin: str) -> None:
    assert await fetch(client, f"{origin}/ok") == b"pinned"


async def test_loopback_is_refused_unless_the_operator_opens_it(
    client: HttpClient, origin: str
) -> None:
    with pytest.raises(UrlValidationError, match="blocked"):
        await fetch(client, f"{origin}/ok", policy=UrlValidationPolicy(allow_http=True))


BLOCKED_HOPS = {
    "metadata": "http://169.254.169.254/latest/meta-data/",
    "localhost name": "http://localhost:{port}/ok",
    "name resolving to private": "http://internal.test/",
    "IPv4-mapped loopback": "http://[::ffff:127.0.0.1]:{port}/ok",
    "decimal loopback": "http://2130706433:{port}/ok",
    "file": "file:///etc/passwd",
    "private range": "http://10.0.0.1/",
}


@pytest.mark.parametrize("target", BLOCKED_HOPS.values(), ids=BLOCKED_HOPS.keys())
async def test_a_redirect_to_a_blocked_host_is_refused(
    client: HttpClient, origin: str, target: str
) -> None:
    port = origin.rsplit(":", 1)[1]
    url = f"{origin}/redirect?to={quote(target.format(port=port), safe='')}"
    with pytest.raises(UrlValidationError):
        await fetch(client, url)


async def test_redirects_are_followed_up_to_three_hops(client: HttpClient, origin: str) -> None:
    assert await fetch(client, f"{origin}/redirect?to=/ok") == b"pinned"
    assert await fetch(client, f"{origin}/chain/3") == b"end of chain"
    with pytest.raises(UrlValidationError, match=r"Too many redirects \(max=3\)"):
        await fetch(client, f"{origin}/chain/4")


async def test_the_connection_goes_to_the_checked_address(
    client: HttpClient,
    second_origin: str,
    fake_dns: Callable[[str], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: the name first resolves to the allowed 127.0.0.2, then to 127.0.0.1
    (blocked, and nothing listens there). Only the first answer may be used."""
    from penstock.http import urls

    answers = iter([["127.0.0.2"], ["127.0.0.1"], ["127.0.0.1"]])
    looked_up: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return next(answers)

    monkeypatch.setattr(urls, "resolve_host", rebinding)
    policy = UrlValidationPolicy(allow_http=True, allowed_networks=("127.0.0.2/32",))
    port = second_origin.rsplit(":", 1)[1]
    assert await fetch(client, f"http://rebind.test:{port}/ok", policy=policy) == b"pinned"
    assert looked_up == ["rebind.test"]


async def test_a_body_over_the_limit_fails_while_streaming(client: HttpClient, origin: str) -> None:
    started = time.monotonic()
    with pytest.raises(UrlValidationError, match="100000 byte download limit"):
        await fetch(client, f"{origin}/endless", max_bytes=100_000)
    assert time.monotonic() - started < 4
    assert len(await fetch(client, f"{origin}/ok", max_bytes=6)) == 6


async def test_an_encoded_body_is_decoded_and_held_to_the_limit(
    client: HttpClient, origin: str
) -> None:
    assert await fetch(client, f"{origin}/gzip") == b"pinned"
    with pytest.raises(UrlValidationError, match="1000000 byte download limit"):
        await fetch(client, f"{origin}/bomb", max_bytes=1_000_000)


async def test_a_trusted_egress_proxy_carries_the_fetch(
    client: HttpClient, origin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on 127.0.0.9:1; the origin answers as the proxy. Only the target is
    # allowed by the policy: the operator's proxy is not judged by it.
    policy = UrlValidationPolicy(allow_http=True, allowed_networks=("127.0.0.9/32",))
    target = "http://127.0.0.9:1/ok"
    monkeypatch.setenv("HTTP_PROXY", origin)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with pytest.raises(HttpConnectionError):
        await fetch(client, target, policy=policy)
    monkeypatch.setenv("DYN_MM_TRUST_EGRESS_PROXY", "1")
    assert await fetch(client, target, policy=policy) == b"pinned"
    with pytest.raises(UrlValidationError, match="blocked"):
        await fetch(client, "http://10.1.2.3/ok", policy=policy)
    monkeypatch.setenv("NO_PROXY", "127.0.0.9")
    with pytest.raises(HttpConnectionError):
        await fetch(client, target, policy=policy)


async def test_a_slow_body_times_out_at_the_deadline(client: HttpClient, origin: str) -> None:
    started = time.monotonic()
    with pytest.raises(HttpTimeoutError):
        await client.fetch_bytes(f"{origin}/trickle", 1.0, policy=LOOPBACK_OPEN)
    assert time.monotonic() - started < 3


async def test_an_error_status_keeps_its_code(client: HttpClient, origin: str) -> None:
    with pytest.raises(HttpStatusError) as failed:
        await fetch(client, f"{origin}/status/404")
    assert failed.value.status == 404 and failed.value.status_code == 404
    assert str(failed.value).startswith(f"HTTP 404 for {origin}/status/404: ")


async def test_a_refused_connection_is_a_connection_error(client: HttpClient) -> None:
    with pytest.raises(HttpConnectionError):
        await fetch(client, "http://127.0.0.1:9/ok")


async def test_without_a_policy_the_configured_one_guards_every_connection(
    origin: str, request: pytest.FixtureRequest
) -> None:
    """The backend follows redirects itself; its connect step still checks each address."""
    answers: dict[str, list[type[HttpError] | bytes]] = {}
    for name, backend in sorted(BACKENDS.items()):
        strict, open_ = backend(), backend(HttpConfigBase(policy=LOOPBACK_OPEN))
        got: list[type[HttpError] | bytes] = []
        try:
            for client, url in (
                (strict, f"{origin}/ok"),
                (open_, f"{origin}/redirect?to=/ok"),
                (open_, f"{origin}/redirect?to={quote('http://169.254.169.254/', safe='')}"),
                (open_, "http://internal.test/"),
            ):
                try:
                    got.append(await client.fetch_bytes(url, 5.0))
                except HttpError as exc:
                    got.append(type(exc))
        finally:
            await strict.close()
            await open_.close()
        answers[name] = got
    assert answers["httpx"] == answers["aiohttp"]
    assert answers["httpx"] == [
        HttpConnectionError,
        b"pinned",
        HttpConnectionError,
        HttpConnectionError,
    ]
