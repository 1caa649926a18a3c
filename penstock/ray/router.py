"""The Ray Serve request router of the engine deployment: :mod:`penstock.ray.routing`'s
rule applied to the replicas Serve knows.

Serve constructs :class:`AffinityRouter` in the process that holds the deployment handle
(the ingress) from its import path, given in the deployment's ``request_router_config``
(see :func:`penstock.ray.fleet.deployment_options`); this module imports Ray, so nothing
imports it before Ray is known to be installed.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from penstock.ray.routing import AFFINITY_KWARG, SAMPLE, choose, in_rotation, preference


class AffinityRouter(RequestRouter):
    """Least loaded, preferring the replica a request's affinity key ranks first."""

    def initialize_state(self, max_imbalance: int = 8, **kwargs: Any) -> None:
        self._max_imbalance = max_imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidate_replicas = in_rotation(
            self._deployment_id.app_name,
            candidate_replicas,
            lambda replica: replica.replica_id.to_full_id_str(),
        )
        if pending_request is not None:
            # Serve retries with a growing back-off until a chosen replica accepts.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        key = None
        if pending_request is not None:
            key = pending_request.kwargs.get(AFFINITY_KWARG)
        if not key or len(candidate_replicas) == 1:
            count = min(len(candidate_replicas), SAMPLE)
            # Serve takes the least loaded of one rank, asking each replica its load.
            return [random.sample(candidate_replicas, count)]
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        order = [by_id[name] for name in preference(str(key), list(by_id))]
        preferred, others = order[0], order[1:]
        sampled = random.sample(others, min(len(others), SAMPLE - 1))
        loads = [
            (replica, load if load is not None and load < replica.max_ongoing_requests else None)
            for replica, load in await self._probe_queue_lens([preferred, *sampled], 0)
        ]
        chosen = choose(preferred, loads, max_imbalance=self._max_imbalance)
        return [[chosen]] if chosen is not None else []
