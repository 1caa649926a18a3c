"""Which engine replica serves a request: least loaded, with bounded cache affinity.

The rule (``penstock serve --ray``):

1. The ingress computes an *affinity key* per request (:func:`affinity_key`): the session
   key when the client names one (the ``X-Session-Id`` header, else the body's ``user``),
   otherwise the first ``--ray-affinity-prefix-tokens`` prompt token ids, together with
   the model name so a LoRA adapter's sessions are keyed apart from the base model's. A
   prompt shorter than that has no key (too little cache to be worth a busier replica),
   and neither has any request without a session key under
   ``--ray-affinity-prefix-tokens 0``.
2. A request without a key goes to the least-loaded replica (fewest streams the ingress
   has running on it) among up to :data:`SAMPLE` replicas drawn at random: exact
   for fleets of up to four replicas, "power of d choices" beyond.
3. A request with a key prefers the replica the key ranks first by rendezvous hashing
   (:func:`preference`): every ingress agrees on it without shared state, and when a
   replica leaves or joins only the keys it ranked first move. The preferred replica is
   taken unless it has more than ``--ray-affinity-max-imbalance`` ongoing requests beyond
   the least-loaded one sampled (or its queue is full); then the least-loaded one is.
4. Only replicas *in rotation* are candidates: once a fleet weight update has committed,
   the ingress publishes the replicas that hold the fleet's weights (:func:`set_rotation`)
   and a replica Ray starts later (a replacement, autoscaling) gets no request until the
   ingress has brought it to the fleet's version (:mod:`penstock.ray.rotation`). With no
   replica in rotation, requests wait until one is.

This module is the policy and imports no Ray; the ingress applies it to each stream
(:mod:`penstock.ray.streams`), :mod:`penstock.ray.router` to the Serve handle's calls to
one replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from penstock.engines.context import Context

# Session key in an engine context's metadata (see ``serving.requests.engine_context``).
SESSION_METADATA = "x-session-id"
# Replicas whose load is compared per request.
SAMPLE = 4

R = TypeVar("R")

# Per Serve application: the replica names in rotation, or absent while every replica is.
# Written by the ingress's fleet engine, read by the router (another thread): each value
# is replaced whole, never mutated.
_ROTATION: dict[str, frozenset[str]] = {}


def set_rotation(app_name: str, replicas: frozenset[str] | None) -> None:
    """Route ``app_name``'s requests only to ``replicas`` (``None``: to every replica)."""
    if replicas is None:
        _ROTATION.pop(app_name, None)
    else:
        _ROTATION[app_name] = replicas


def in_rotation(app_name: str, replicas: Sequence[R], name: Callable[[R], str]) -> list[R]:
    """The replicas of ``app_name`` that may serve requests now."""
    allowed = _ROTATION.get(app_name)
    if allowed is None:
        return list(replicas)
    return [replica for replica in replicas if name(replica) in allowed]


def affinity_key(request: Mapping[str, Any], context: Context, prefix_tokens: int) -> str | None:
    """The request's affinity key (a short hex digest), or ``None`` when it has none."""
    model = str(request.get("model") or "")
    session = context.metadata.get(SESSION_METADATA)
    if session:
        material = f"s\0{model}\0{session}"
    else:
        token_ids = request.get("token_ids")
        if prefix_tokens <= 0 or not token_ids or len(token_ids) < prefix_tokens:
            return None
        prefix = ",".join(str(int(t)) for t in token_ids[:prefix_tokens])
        material = f"p\0{model}\0{prefix}"
    return hashlib.blake2b(material.encode(), digest_size=8).hexdigest()


def _score(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


def preference(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in the key's rendezvous order, the preferred one first."""
    return sorted(replicas, key=lambda replica: _score(key, replica), reverse=True)


def choose(
    preferred: R | None, loads: Sequence[tuple[R, int | None]], *, max_imbalance: int
) -> R | None:
    """The replica to serve the request, from the ongoing request counts of the preferred
    replica (when the request has a key) and the sampled ones.

    A count of ``None`` is a replica that did not answer or whose queue is full: never
    chosen. ``None`` when no replica can take the request now.
    """
    known = [(replica, load) for replica, load in loads if load is not None]
    if not known:
        return None
    least, fewest = min(known, key=lambda pair: pair[1])
    if preferred is not None:
        mine = next((load for replica, load in known if replica is preferred), None)
        if mine is not None and mine - fewest <= max_imbalance:
            return preferred
    return least
