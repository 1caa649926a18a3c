"""A loopback stand-in for S3: path-style ListObjectsV2, HeadObject and GetObject over
fixed objects, and the environment that points an AWS client at it with dummy
credentials and nothing to fall back on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from tests.support.file_server import serving


def fake_s3(bucket: str, objects: Mapping[str, bytes]) -> type[BaseHTTPRequestHandler]:
    """A handler serving ``objects`` (key -> bytes) as the one bucket ``bucket``; it
    records every request line in its ``requests`` list."""

    class FakeS3(BaseHTTPRequestHandler):
        requests: list[str] = []

        def do_GET(self) -> None:
            self.requests.append(f"GET {self.path}")
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self.requests.append(f"HEAD {self.path}")
            self._answer(with_body=False)

        def _answer(self, with_body: bool) -> None:
            url = urlsplit(self.path)
            name, _, key = url.path.lstrip("/").partition("/")
            key = unquote(key)
            if name != bucket:
                return self._send(404, b"", with_body=with_body)
            if not key:
                return self._send(200, self._listing(url.query), "application/xml", with_body)
            if key not in objects:
                return self._send(404, b"", with_body=with_body)
            return self._send(200, objects[key], "application/octet-stream", with_body)

        def _listing(self, query: str) -> bytes:
            prefix = parse_qs(query).get("prefix", [""])[0]
            keys = sorted(k for k in objects if k.startswith(prefix))
            contents = "".join(
                f"<Contents><Key>{escape(k)}</Key><Size>{len(objects[k])}</Size>"
                "<LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                '<ETag>"0"</ETag><StorageClass>STANDARD</StorageClass></Contents>'
                for k in keys
            )
            return (
                '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(keys)}</KeyCount><IsTruncated>false</IsTruncated>"
                f"{contents}</ListBucketResult>"
            ).encode()

        def _send(
            self, status: int, body: bytes, kind: str = "text/plain", with_body: bool = True
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
            self.send_header("ETag", '"0"')
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    return FakeS3


@contextlib.contextmanager
def fake_s3_endpoint(
    bucket: str, objects: Mapping[str, bytes]
) -> Iterator[tuple[str, type[BaseHTTPRequestHandler]]]:
    """The endpoint URL of a :func:`fake_s3` on a free loopback port, and its handler."""
    handler = fake_s3(bucket, objects)
    with serving(handler) as url:
        yield url, handler


def aws_environment(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """Environment that sends AWS clients to ``endpoint`` with dummy credentials, and
    leaves them no config files or instance metadata to fall back on."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "dummy",
        "AWS_SECRET_ACCESS_KEY": "dummy",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
    }
