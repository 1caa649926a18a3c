"""A loopback HTTP server in a background thread, for tests that need something to fetch
from or upload to; :func:`static_files` makes a handler that serves fixed bytes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``handler`` on a free port of ``host``; yields the base URL, closes on exit."""
    server = ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def static_files(
    files: Mapping[str, bytes], content_type: str = "image/png"
) -> type[BaseHTTPRequestHandler]:
    """A handler answering ``GET <path>`` with ``files[path]``, or an empty 404."""

    class StaticFiles(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: Any) -> None:
            return

    return StaticFiles
