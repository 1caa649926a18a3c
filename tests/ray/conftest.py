"""The local two-node Ray cluster the modules of ``tests/ray`` share (``cluster``), started
by the first test that asks for it and stopped after the package's last test: each module
stops its own servers, and their Serve applications with them. Two logical CPUs per node:
two fleets of two one-CPU replicas fit at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of ``tests/ray`` that use no ``cluster`` run first, each module whole and
    in its own order: the cluster then starts with the first module that asks for it and
    stops with the package's last test, so it never runs beside the others' own clusters
    and servers."""
    here = Path(__file__).parent
    ours = [index for index, item in enumerate(items) if here in item.path.parents]
    if not ours:
        return
    first, last = ours[0], ours[-1] + 1
    package = items[first:last]
    if len(ours) != len(package):
        return  # not one run of this package's tests: leave the order as it is
    clustered = {item.path for item in package if "cluster" in getattr(item, "fixturenames", ())}
    items[first:last] = sorted(package, key=lambda item: item.path in clustered)
