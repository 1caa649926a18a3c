"""The e2e ``client``: an HTTP client for the module's own ``server`` fixture (a real
``penstock serve`` whose arguments each module states), in place of the suite's
in-process one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http
