"""The Ray Serve request router of the engine deployment: only replicas in rotation
(:mod:`penstock.ray.routing`), the least loaded of them.

Serve constructs :class:`RotationRouter` in the process that holds the deployment handle
(the ingress) from its import path, given in the deployment's ``request_router_config``
(see :func:`penstock.ray.fleet.deployment_options`); this module imports Ray, so nothing
imports it before Ray is known to be installed.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from penstock.ray.routing import SAMPLE, in_rotation


class RotationRouter(RequestRouter):
    """The least loaded of the replicas in rotation, for the handle's calls to one replica
    (a LoRA adapter's first load); streams are routed by the ingress itself
    (:mod:`penstock.ray.streams`), with the same rule."""

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
        count = min(len(candidate_replicas), SAMPLE)
        # Serve takes the least loaded of one rank, asking each replica its load.
        return [random.sample(candidate_replicas, count)]
