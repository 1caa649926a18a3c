"""A local two-node Ray cluster for the tests in ``tests/ray``, with this process joined to it.

Replicas import the test engines from this checkout, so ``PYTHONPATH`` names it before the
cluster's processes start. Import this module after ``pytest.importorskip("ray")``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray import serve
from ray.cluster_utils import Cluster

from tests.support.server import REPO_ROOT


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int) -> Iterator[Cluster]:
    os.environ["PYTHONPATH"] = str(REPO_ROOT)
    started = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False},
    )
    started.add_node(num_cpus=cpus_per_node)
    started.wait_for_nodes()
    ray.init(address=started.address, log_to_driver=False)
    try:
        yield started
    finally:
        serve.shutdown()
        ray.shutdown()
        started.shutdown()
