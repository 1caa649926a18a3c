"""The local two-node Ray cluster the modules of ``tests/ray`` share (``cluster``), started
by the first test that asks for it and stopped after the package's last test: each module
stops its own servers, and their Serve applications with them. Two logical CPUs per node:
two fleets of two one-CPU replicas fit at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="package")
def cluster() -> Iterator[Any]:
    pytest.importorskip(
        "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
    )
    from tests.support.ray_cluster import two_node_cluster

    with two_node_cluster(cpus_per_node=2) as started:
        yield started
