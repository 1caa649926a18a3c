"""The ingress side of ``penstock serve --ray``: the engine deployment and its host stand-in.

:func:`start_fleet` connects to Ray (``--ray-address``, else a local cluster), deploys
:class:`~penstock.ray.replica.EngineReplica` with the replica count, resources and
autoscaling asked for, and returns a :class:`FleetHost`. :func:`build_ray_gateway` registers
the served model from what a replica describes, as ``build_gateway`` does for a local
engine, so the serving layer, the routers and the server (drain, connection limits) run
unchanged.

* Data plane and routing: :mod:`penstock.ray.streams` picks each stream's replica (the
  least loaded, or the one a request's session or prompt prefix prefers within a bound:
  :mod:`penstock.ray.routing`) and carries its chunks over one connection per replica;
  Ray carries the control plane only. LoRA adapters: :mod:`penstock.ray.adapters`. Metrics:
  :mod:`penstock.ray.metrics`.
* Admission: the ingress holds the one :class:`AdmissionGate`, so ``--max-concurrency`` and
  ``--max-queue`` bound the whole fleet; each replica accepts as many requests as that.
* Cancellation: a consumer going away (client gone, deadline, a stop string, ``cancel``)
  cancels the stream on its replica; the replica's host then kills the request's context and
  aborts it once. A request whose replica dies fails with :class:`ReplicaLostError`
  (an error frame and ``[DONE]`` once streaming) and Serve starts a replacement.
* Admin: the admin plane drives :class:`~penstock.ray.fleet_admin.FleetEngine`, which fans
  every control out to the replicas and runs a weight update as one fleet-wide
  transaction (pause, update, verify, resume, or roll every replica back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from penstock.engines.admission import AdmissionGate
from penstock.engines.constants import ModelInput
from penstock.engines.context import Context
from penstock.engines.contract import EngineConfig
from penstock.engines.health import is_probe
from penstock.engines.host import EngineState, HealthStatus
from penstock.errors import (
    EngineError,
    RaySetupError,
    ReplicaLostError,
)
from penstock.ray import require_ray
from penstock.ray.adapters import FleetAdapters
from penstock.ray.fleet_admin import FleetEngine
from penstock.ray.local_cluster import LocalCluster
from penstock.ray.metrics import SCRAPE_TIMEOUT_S, fleet_families, labelled_families, render
from penstock.ray.replica import EngineReplica
from penstock.ray.replica_header import note_replica
from penstock.ray.replica_load import POLICY_PATH as AUTOSCALING_POLICY_PATH
from penstock.ray.routing import affinity_key
from penstock.ray.streams import FleetStreams, IngressStream
from penstock.ray.wire import entry_error
from penstock.settings import Settings

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "penstock-engine"
# Imported by Serve, so this module needs no Ray to import (see penstock.ray.router).
ROUTER_IMPORT_PATH = "penstock.ray.router:RotationRouter"
# How long stopping the deployment may take at exit (replicas drain their own requests).
_SHUTDOWN_S = 20.0
# How often /health's per-replica view (state, weight version, running) is refreshed.
_FLEET_VIEW_S = 1.0
# Replica slots beyond --max-concurrency, so admin broadcasts reach a full replica.
_ADMIN_SLOTS = 4


@dataclass
class ReplicaLoad:
    """What the ingress has seen of one replica."""

    served: int = 0
    running: int = 0
    lost: int = 0
    tokens: int = 0


class FleetHost:
    """Stands where :class:`~penstock.engines.host.EngineHost` stands, for a Serve fleet."""

    def __init__(
        self,
        handle: Any,
        description: dict[str, Any],
        settings: Settings,
        *,
        cluster: LocalCluster | None,
        data_token: str,
    ) -> None:
        self._ray, self._serve = require_ray()
        self._handle = handle
        self._settings = settings
        self._cluster = cluster
        self.adapters = FleetAdapters(handle, set(description.get("updates", ())))
        self.engine = FleetEngine(handle, description, self.adapters, settings.ray_app_name)
        self.engine_config: EngineConfig = description["engine_config"]
        self.model_input: ModelInput = description["model_input"]
        self.worker_config = SimpleNamespace(**description["worker"])
        self.worker_id = 0
        self.state = EngineState.RUNNING
        self.health = HealthStatus()
        self.admission: AdmissionGate | None = None
        self.replicas: dict[str, ReplicaLoad] = {}
        # Outlives the replicas: a dead one's series leave the metrics with it.
        self.lost_requests = 0
        self.streams = FleetStreams(
            data_token,
            settings.ray_app_name,
            settings.ray_affinity_max_imbalance,
            lambda name: self.replicas[name].running if name in self.replicas else 0,
        )
        self.engine.on_view = self._take_view
        self._background: set[asyncio.Task[Any]] = set()
        self._streams: weakref.WeakKeyDictionary[Context, IngressStream] = (
            weakref.WeakKeyDictionary()
        )
        self._view_task: asyncio.Task[Any] | None = None

    @property
    def is_raw(self) -> bool:
        return self.model_input is ModelInput.Text

    @property
    def served_model_name(self) -> str:
        configured = getattr(self.worker_config, "served_model_name", None)
        return str(configured or self.engine_config.served_model_name or self.engine_config.model)

    def describe_fleet(self) -> dict[str, Any]:
        """Per live replica (those that answered the last view), as seen from here: its
        state and checksum, requests served, running, lost to its death."""
        view = self.engine.view
        return {
            "deployment": DEPLOYMENT_NAME,
            # Live replicas as last asked: the ranks a trainer's weights update group needs.
            "size": sum(1 for entry in view.values() if "state" in entry),
            "replicas": {
                name: {
                    **view.get(name, {}),
                    **vars(self.replicas.get(name, ReplicaLoad())),
                    **self.engine.rotation.state(name),
                }
                for name in sorted(view)
            },
            "fleet_weights": self.engine.rotation.fleet_weights,
            "weight_versions": sorted({v.get("weight_version") for v in view.values()}, key=str),
            "checked_at": self.engine.view_at,
        }

    def _take_view(self, view: dict[str, dict[str, Any]]) -> None:
        self.streams.update(view)
        # A replica gone from the fleet (dead, scaled in) leaves /health and the metrics.
        for name in [n for n, load in self.replicas.items() if n not in view and not load.running]:
            del self.replicas[name]

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def cancel(self, context: Context) -> None:
        """Stop the request: its replica's host kills its context and aborts it once."""
        context.stop_generating()
        stream = self._streams.get(context)
        if stream is not None:
            stream.cancel()

    async def generate(self, request: dict[str, Any], context: Context) -> AsyncIterator[dict]:
        if self.state is not EngineState.RUNNING:
            raise EngineError("engine is not running")
        gate = None if is_probe(request) else self.admission
        if gate is not None:
            await gate.acquire()
        try:
            async for chunk in self._remote(request, context):
                yield chunk
        finally:
            if gate is not None:
                gate.release()

    async def _remote(self, request: dict[str, Any], context: Context) -> AsyncIterator[dict]:
        """The ingress's end of the data plane (:mod:`penstock.ray.streams`): the chosen
        replica's batches as chunks, its error raised again."""
        name, stream = await self.streams.open(
            context.id(),
            request,
            self.adapters.route(request.get("model")),
            affinity_key(request, context, self._settings.ray_affinity_prefix_tokens),
        )
        self._streams[context] = stream
        note_replica(name)
        load = self.replicas.setdefault(name, ReplicaLoad())
        load.served += 1
        load.running += 1
        completed = False
        try:
            async for batch in stream.batches():
                for item in batch:
                    error = entry_error(item)
                    if error is not None:
                        raise error
                    load.tokens += len(item.get("token_ids") or ())
                    yield item
            completed = True
        except ReplicaLostError as exc:
            load.lost += 1
            self.lost_requests += 1
            logger.warning("request %s lost its engine replica %s: %s", context.id(), name, exc)
            raise
        finally:
            self._streams.pop(context, None)
            load.running -= 1
            if not completed:
                stream.cancel()

    async def metrics_text(self) -> str:
        """Each replica's engine families, labelled with the replica, and the ingress's
        view of each replica (:mod:`penstock.ray.metrics`)."""
        try:
            replies = await self._handle.broadcast("metrics_text").results_async(
                timeout_s=SCRAPE_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            logger.warning("the replicas' metrics did not arrive within %gs", SCRAPE_TIMEOUT_S)
            replies = []
        texts = {str(r[0]): str(r[1]) for r in replies if isinstance(r, tuple | list)}
        live = {name: load for name, load in self.replicas.items() if name in self.engine.view}
        families = fleet_families(live, texts, self.lost_requests) + labelled_families(texts)
        return render(families)

    def start_monitor(self) -> None:
        """Serve probes each replica's ``check_health`` and replaces the failing ones; the
        fleet view of ``/health`` is refreshed every ``_FLEET_VIEW_S``."""
        self._view_task = self.spawn(self.engine.refresh_forever(_FLEET_VIEW_S))

    async def stop_monitor(self) -> None:
        task, self._view_task = self._view_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def cleanup(self) -> None:
        """Delete the deployment, or stop Serve and end the Ray cluster this process
        started; bounded, since a cluster whose processes were signalled too may no
        longer answer."""
        if self.state is EngineState.STOPPED:
            return
        self.state = EngineState.STOPPED
        self.streams.close()
        try:
            async with asyncio.timeout(_SHUTDOWN_S):
                await asyncio.to_thread(self._stop_serving)
        except TimeoutError:
            logger.warning("Ray Serve did not stop within %gs; leaving it", _SHUTDOWN_S)
        if self._cluster is not None:
            self._ray.shutdown()
            await asyncio.to_thread(self._cluster.stop)

    def _stop_serving(self) -> None:
        try:
            if self._cluster is not None:
                self._serve.shutdown()
            else:
                self._serve.delete(self._settings.ray_app_name)
        except Exception:
            logger.warning("stopping the Ray Serve application failed", exc_info=True)


def deployment_options(settings: Settings) -> dict[str, Any]:
    """The engine deployment's Serve options from the ``--ray-*`` settings."""
    actor: dict[str, Any] = {"num_cpus": settings.ray_replica_cpus}
    if settings.ray_replica_gpus:
        actor["num_gpus"] = settings.ray_replica_gpus
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": actor,
        # The ingress gate bounds the fleet; a replica never refuses what it admitted.
        "max_ongoing_requests": max(settings.max_concurrency, 1) + _ADMIN_SLOTS,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_s,
        "request_router_config": {"request_router_class": ROUTER_IMPORT_PATH},
    }
    low, high = settings.ray_min_replicas, settings.ray_max_replicas
    if low is None and high is None:
        options["num_replicas"] = settings.ray_replicas
        return options
    low = settings.ray_replicas if low is None else low
    high = max(low, settings.ray_replicas) if high is None else high
    options["autoscaling_config"] = {
        "min_replicas": low,
        "max_replicas": high,
        "initial_replicas": min(max(settings.ray_replicas, low), high),
        "target_ongoing_requests": settings.ray_target_ongoing_requests,
        "upscale_delay_s": settings.ray_upscale_delay_s,
        # Serve sees no stream: the replicas report theirs (penstock.ray.replica_load).
        "policy": {"policy_function": AUTOSCALING_POLICY_PATH},
    }
    return options


def _deploy(
    settings: Settings, data_token: str, cluster: LocalCluster | None
) -> tuple[Any, dict[str, Any]]:
    ray, serve = require_ray()
    try:
        if not ray.is_initialized():
            # "local" (Ray imported before a cluster could be made): a new one in this
            # server's group, not one another process runs on this machine.
            address = settings.ray_address or (cluster.start() if cluster else "local")
            local = {"include_dashboard": False} if address == "local" else {}
            ray.init(address=address, log_to_driver=False, **local)
        # The gateway process is the HTTP ingress: no Serve proxy is needed.
        serve.start(proxy_location="Disabled")
        app = serve.deployment(EngineReplica).options(**deployment_options(settings))
        handle = serve.run(
            app.bind(settings, data_token),
            name=settings.ray_app_name,
            route_prefix=None,
            blocking=False,
        )
        description = handle.describe.remote().result()
    except Exception as exc:
        reason = _replica_failure(serve, settings.ray_app_name) or str(exc)
        if cluster is not None:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            cluster.stop()
        else:
            # Serve would go on retrying the replicas on a cluster that outlives this server.
            with contextlib.suppress(Exception):
                serve.delete(settings.ray_app_name)
        raise RaySetupError(f"the engine deployment on Ray failed to start: {reason}") from exc
    return handle, description


async def _in_daemon_thread(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` off the loop in a daemon thread: unlike ``asyncio.to_thread``'s
    pool, an abandoned deploy still blocked in Ray does not hold the process's exit."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if outcome.done():
            return
        if error is None:
            outcome.set_result(result)
        else:
            outcome.set_exception(error)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:
            result, error = None, exc
        # The loop is closed once the server has exited without waiting for this thread.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="penstock-ray-deploy", daemon=True).start()
    return await outcome


def _replica_failure(serve: Any, app_name: str) -> str | None:
    """The last line of the traceback a replica's constructor raised (Serve keeps it in the
    deployment's status; its own exception only says the deployment failed)."""
    try:
        status = serve.status().applications[app_name].deployments[DEPLOYMENT_NAME]
    except Exception:
        return None
    lines = [line.strip() for line in str(status.message or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


async def start_fleet(settings: Settings) -> FleetHost:
    """Deploy the engine replicas and wait until they serve; raises
    :class:`~penstock.errors.RaySetupError` with the reason otherwise."""
    # Without an address, a new cluster of this server's own (never one already running
    # on this machine, whose Serve this server would then stop), in a process group of
    # its own; made before Ray is imported (see LocalCluster).
    cluster = None if settings.ray_address or "ray" in sys.modules else LocalCluster()
    ray, _ = require_ray()
    if ray.is_initialized():
        cluster = None
    data_token = secrets.token_hex(16)
    try:
        handle, description = await _in_daemon_thread(_deploy, settings, data_token, cluster)
    except BaseException:
        # A start abandoned (the server told to stop while it deploys): the cluster is
        # this server's own and in a group of its own, so nothing else would end it.
        if cluster is not None:
            cluster.stop()
        raise
    host = FleetHost(handle, description, settings, cluster=cluster, data_token=data_token)
    # The first view gives the routing its replicas' data plane addresses.
    await host.engine.refresh()
    host.admission = AdmissionGate(
        settings.max_concurrency,
        settings.max_queue,
        settings.overload_status,
        shed_log_interval_s=settings.overload_log_interval_s,
    )
    logger.info(
        "Ray Serve deployment %s ready (%s)",
        DEPLOYMENT_NAME,
        ", ".join(f"{k}={v}" for k, v in deployment_options(settings).items() if k != "name"),
    )
    return host
