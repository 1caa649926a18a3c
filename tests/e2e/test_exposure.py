"""A server reachable beyond loopback with no inference key says so once at startup."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.server import running_server

WARNING = "anyone who can reach port"


def test_no_key_on_a_public_address_warns_once(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--host", "0.0.0.0"]
    with running_server(args, tmp_path) as server:
        # Nothing to protect without keys: the docs stay open.
        assert httpx.get(f"{server.base_url}/openapi.json").status_code == 200
        server.stop()
    lines = [line for line in server.log().splitlines() if WARNING in line]
    assert len(lines) == 1
    assert "WARNING" in lines[0]
    assert "no --api-key set and listening on 0.0.0.0" in lines[0]
    assert "admin routes answer loopback clients only" in lines[0]


def test_a_keyed_or_loopback_server_does_not_warn(tmp_path: Path) -> None:
    with running_server(["--engine", "sample", "--api-key", "k"], tmp_path) as server:
        assert httpx.get(f"{server.base_url}/docs").status_code == 401
        server.stop()
    assert WARNING not in server.log()
