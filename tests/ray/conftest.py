"""The local two-node Ray cluster of a module in ``tests/ray`` (``cluster``): one logical
CPU per node unless the module's ``CPUS_PER_NODE`` says more."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    pytest.importorskip(
        "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
    )
    from tests.support.ray_cluster import two_node_cluster

    with two_node_cluster(cpus_per_node=getattr(request.module, "CPUS_PER_NODE", 1)) as started:
        yield started
