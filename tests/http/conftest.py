"""A loopback origin for the fetch tests and a fake DNS: no test resolves a real name."""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

import pytest

from penstock.http import urls
from tests.support.file_server import serving
from tests.support.media_files import gzip, zero_bomb

# Names the fake resolver knows; anything else fails to resolve, as offline DNS would.
FAKE_DNS: dict[str, list[str]] = {
    "media.test": ["93.184.216.34"],
    "v6.media.test": ["2606:2800:220:1:248:1893:25c8:1946"],
    "internal.test": ["10.1.2.3"],
    "mapped.test": ["::ffff:169.254.169.254"],
    "mixed.test": ["93.184.216.34", "127.0.0.1"],
    "loopback.test": ["127.0.0.1"],
}


_GZIPPED = gzip(b"pinned")
# 32 MB of zeros in two gzip layers: a few KB on the wire.
_BOMB = zero_bomb(32)


class Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body = b"pinned"

    def log_message(self, *args: object) -> None:
        return

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, chunks: Iterator[bytes]) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            return

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        if parts.path == "/ok":
            self._send(200, self.body)
        elif parts.path == "/redirect":
            self._send(302, headers={"Location": query["to"][0]})
        elif parts.path.startswith("/chain/"):
            left = int(parts.path.rsplit("/", 1)[1])
            if left == 0:
                self._send(200, b"end of chain")
            else:
                self._send(302, headers={"Location": f"/chain/{left - 1}"})
        elif parts.path == "/gzip":
            self._send(200, _GZIPPED, {"Content-Encoding": "gzip"})
        elif parts.path == "/bomb":
            self._send(200, _BOMB, {"Content-Encoding": "gzip, gzip"})
        elif parts.path == "/status/404":
            self._send(404, b"no such image")
        elif parts.path == "/endless":
            # Without a length; far more than any test allows (a limit checked after the
            # download would hang the test instead of failing it).
            self._stream(b"x" * 65536 for _ in range(4096))
        elif parts.path == "/trickle":
            self._stream((time.sleep(0.2) or b"x") for _ in range(100))
        else:
            self._send(404)


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    with serving(Origin) as url:
        yield url


@pytest.fixture(scope="module")
def second_origin() -> Iterator[str]:
    """Listens on 127.0.0.2 only: a connection to 127.0.0.1 on its port is refused."""
    with serving(Origin, "127.0.0.2") as url:
        yield url


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], int]:
    calls: dict[str, int] = {}

    async def resolve(host: str, port: int) -> list[str]:
        calls[host] = calls.get(host, 0) + 1
        if host not in FAKE_DNS:
            raise OSError(f"unknown host {host}")
        return list(FAKE_DNS[host])

    monkeypatch.setattr(urls, "resolve_host", resolve)
    return lambda host: calls.get(host, 0)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fetch that slipped past the checks must not leave the machine: it is refused
    here, and the test fails."""
    connect = socket.socket.connect
    escaped: list[object] = []

    def guarded(sock: socket.socket, address: object) -> object:
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            escaped.append(address)
            raise ConnectionRefusedError(f"a test tried to connect to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    assert escaped == [], f"connections left the machine: {escaped}"
