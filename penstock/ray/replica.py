"""One engine replica of the Ray Serve deployment: an :class:`EngineHost` in a Serve actor.

The replica constructs and starts the engine exactly as the single-process server does
(``--engine`` and the arguments after ``--`` unchanged), with the same host guarantees:
start once, cleanup once (Serve calls ``__del__`` when it stops the replica), one terminal
per choice, a consumer going away kills the request's context and aborts it once, the
canary. Admission is not applied here: the ingress holds the one fleet-wide gate.

Streams leave the replica as batches over its own port (:mod:`penstock.ray.batching`, the
data plane, off Ray's per-message path); admin calls run in
:class:`~penstock.ray.replica_admin.ReplicaAdmin` (the control plane). Errors cross to the
ingress in the one format of :mod:`penstock.ray.wire`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from penstock.engines.context import Context
from penstock.engines.host import EngineState
from penstock.engines.host_setup import build_host
from penstock.engines.loading import engine_argv, load_engine_class
from penstock.engines.metric_outlets import bridge_engine_metrics
from penstock.errors import PenstockError
from penstock.ray.adapters import ReplicaAdapters
from penstock.ray.batching import StreamServer
from penstock.ray.metrics import ReplicaMetrics
from penstock.ray.replica_admin import ReplicaAdmin
from penstock.ray.replica_load import RUNNING_STREAMS
from penstock.ray.wire import ADDRESS_KEY, error_entry
from penstock.settings import Settings

logger = logging.getLogger(__name__)

# Worker-config fields the ingress needs to register the served model and tokenize.
_WORKER_FIELDS = (
    "served_model_name",
    "model_name",
    "endpoint_types",
    "tool_call_parser",
    "reasoning_parser",
    "namespace",
    "component",
    "endpoint",
)


def replica_name() -> str:
    """This replica's Serve actor name (``ray.get_actor(name, namespace="serve")`` finds it),
    else host and pid."""
    with contextlib.suppress(Exception):
        import ray

        name = ray.get_runtime_context().get_actor_name()
        if name:
            return str(name)
    return f"{socket.gethostname()}:{os.getpid()}"


def node_address() -> str:
    """The address other nodes reach this one at (Ray's node IP), else loopback."""
    with contextlib.suppress(Exception):
        import ray

        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


class EngineReplica:
    """The engine deployment's class; Serve constructs it once per replica."""

    async def __init__(self, settings: Settings, data_token: str) -> None:
        """``data_token``: what an ingress shows to open streams on this replica's data
        plane port."""
        engine_cls = load_engine_class(settings.engine)
        engine, worker_config = await engine_cls.from_args(engine_argv(settings))
        self.host = build_host(settings, engine, worker_config)
        self.name = replica_name()
        self._live: dict[str, Context] = {}
        self.adapters = ReplicaAdapters(engine)
        self.metrics = ReplicaMetrics()
        try:
            await self.host.start()
            await bridge_engine_metrics(
                engine,
                self.host,
                self.metrics.engine_metrics,
                self.metrics.registry,
                settings.served_model_name or self.host.served_model_name,
            )
        except BaseException:
            await self.host.cleanup()
            raise
        self.host.start_monitor()
        self._data_plane = StreamServer(self._stream, data_token, f"replica {self.name}")
        self.data_address = await self._data_plane.start(node_address())
        self._admin = ReplicaAdmin(self.host, self.name)
        logger.info("engine replica %s ready", self.name)

    def describe(self) -> dict[str, Any]:
        """What the ingress registers the served model from."""
        worker = self.host.worker_config
        return {
            "replica": self.name,
            "engine_class": type(self.host.engine).__name__,
            "engine_config": self.host.engine_config,
            "model_input": self.host.model_input,
            "worker": {name: getattr(worker, name, None) for name in _WORKER_FIELDS},
            "controls": sorted(self.host.engine.supported_controls()),
            "updates": sorted(self.host.engine.supported_updates()),
        }

    async def _stream(
        self, request_id: str, request: dict[str, Any], adapter: tuple[str, str] | None
    ) -> AsyncIterator[dict[str, Any]]:
        """A request's chunks, for the data plane (:class:`StreamServer`).

        ``adapter`` is the ``(name, path)`` of the LoRA adapter the request names, loaded
        here first if this replica has not loaded it yet. Closing the stream (the
        ingress's client left) ends the request as a local consumer going away does:
        context killed, the engine aborted once.
        """
        context = Context(request_id)
        self._live[request_id] = context
        try:
            if adapter is not None:
                await self.adapters.ensure(*adapter)
            # One generator between the host's chunks and the data plane: each level
            # costs every chunk a resumption.
            async for chunk in self.host.generate(request, context):
                yield chunk
        finally:
            self._live.pop(request_id, None)

    async def admin(self, operation: str, *args: Any) -> dict[str, Any]:
        """One replica's part of a fleet admin call (:mod:`penstock.ray.fleet_admin`), reached
        by ``broadcast``; the answer carries this replica's name."""
        answer = await self._admin.run(operation, *args)
        if operation == "status":
            answer["running"] = len(self._live)
            answer[ADDRESS_KEY] = self.data_address
        return answer

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaling policy scales on (:mod:`penstock.ray.replica_load`):
        the streams this replica runs, which Serve's own count never sees."""
        return {RUNNING_STREAMS: float(len(self._live))}

    def stats(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "state": self.host.state.value,
            "healthy": self.host.health.healthy,
            "running": len(self._live),
        }

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load a LoRA adapter here; ``{"error": ...}`` with the engine's refusal."""
        try:
            await self.adapters.ensure(name, path)
        except PenstockError as exc:
            return error_entry(exc)
        return {"replica": self.name}

    async def unload_adapter(self, name: str) -> bool:
        return await self.adapters.unload(name)

    def metrics_text(self) -> tuple[str, str]:
        """``(replica name, its engine families as Prometheus text)``."""
        return self.name, self.metrics.render()

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine stopped or failed its canary is
        replaced."""
        if self.host.state is not EngineState.RUNNING:
            raise RuntimeError(f"engine is {self.host.state.value}")
        if not self.host.health.healthy:
            raise RuntimeError(self.host.health.reason or "engine unhealthy")

    async def __del__(self) -> None:
        # Serve calls this after a constructor that failed before the host existed, too.
        data_plane = getattr(self, "_data_plane", None)
        if data_plane is not None:
            await data_plane.close()
        host = getattr(self, "host", None)
        if host is not None:
            await host.cleanup()
