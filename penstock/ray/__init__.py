"""Penstock on Ray Serve: engine replicas as a Serve deployment behind one gateway.

``penstock serve --ray`` keeps the gateway process (HTTP, validation, tokenization,
detokenizing, SSE, admission, drain) as the ingress and runs the engine as a Ray Serve
deployment of :class:`~penstock.ray.replica.EngineReplica`, each replica one
:class:`~penstock.engines.host.EngineHost`. The serving layer reaches the fleet through
:class:`~penstock.ray.fleet.FleetHost`, which stands where the local ``EngineHost`` stands.

Ray is optional (``pip install 'penstock[ray]'``): nothing here imports it at module level,
and :func:`require_ray` turns its absence into one clear line.
"""

from __future__ import annotations

from types import ModuleType

from penstock.errors import RaySetupError

RAY_EXTRA_HINT = "--ray needs Ray Serve: pip install 'penstock[ray]'"


def require_ray() -> tuple[ModuleType, ModuleType]:
    """``(ray, ray.serve)``; raises :class:`~penstock.errors.RaySetupError` without them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RaySetupError(f"{RAY_EXTRA_HINT} ({exc})") from exc
    return ray, serve
