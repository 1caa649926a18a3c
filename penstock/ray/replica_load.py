"""Serve autoscaling by the streams each replica runs, which Serve itself cannot see.

Serve's own policy scales on the requests its handles and replicas count. Under
``--ray`` tokens travel the data plane (:mod:`penstock.ray.streams`), not Serve's handle
calls, so Serve counts only admin calls and would never scale a busy fleet out. Each
replica therefore reports the streams it runs (``record_autoscaling_stats`` of
:class:`~penstock.ray.replica.EngineReplica`, under :data:`RUNNING_STREAMS`) and the
deployment's policy is :func:`running_streams_policy`: the replicas wanted are the
streams running fleet-wide over ``--ray-target-ongoing-requests``. Serve applies the
bounds (``--ray-min-replicas``, ``--ray-max-replicas``) and its up- and downscale delays
around it as for its own policy.

A fleet scaled to zero replicas reports no stream, and requests wait at the ingress, not
in Serve: it would not scale up again, so ``--ray-min-replicas`` should be 1 or more.

Serve's controller runs the policy from this module pickled by value: it imports nothing
of Penstock.
"""

from __future__ import annotations

from typing import Any

# The metric each replica reports: the streams it runs now.
RUNNING_STREAMS = "penstock_running_streams"
# Serve's import path of the policy.
POLICY_PATH = "penstock.ray.replica_load:running_streams_policy"


def running_streams_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """The replicas wanted for the streams the replicas report (Serve's
    ``AutoscalingContext``), before Serve's bounds and delays; the policy keeps no state."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    reported = ctx.aggregated_metrics.get(RUNNING_STREAMS, {})
    running = sum(reported.values())
    return running / ctx.config.get_target_ongoing_requests(), {}
