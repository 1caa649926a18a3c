"""Start an engine, serve it over HTTP, drain and clean up on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import errno
import gc
import ipaddress
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from penstock import tracing
from penstock.app.connections import ConnectionLimits, guarded_protocol, raise_open_file_limit
from penstock.app.factory import create_app, media_store_location
from penstock.app.middleware import OpenRequests, WireSend
from penstock.engines.admission import AdmissionGate
from penstock.engines.contract import SUPPORTS_DETERMINISTIC, parse_endpoint_types
from penstock.engines.host import EngineHost
from penstock.engines.host_setup import build_host
from penstock.engines.loading import engine_argv, load_engine_class
from penstock.engines.metric_outlets import bridge_engine_metrics
from penstock.errors import EngineLoadError, ListenError
from penstock.gateway import Gateway, ServedModel
from penstock.media.artifacts import check_location
from penstock.media.async_jobs import check_database
from penstock.media.requests import generates_media
from penstock.preprocess import Preprocessor
from penstock.preprocess.reasoning import REASONING_PARSERS
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import Settings

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
# How long the requests cut at the end of the grace period get to send their last message
# (their engine requests are aborted meanwhile) before uvicorn closes what is left.
_CUT_WAIT_S = 2.0


@dataclass(frozen=True)
class Endpoint:
    """What ``on_endpoint_ready`` receives: where the engine is being served."""

    namespace: str
    component: str
    name: str
    url: str


def _tokenizer_folder(settings: Settings, worker_config: Any) -> Path | None:
    if settings.tokenizer:
        return Path(settings.tokenizer)
    model_name = getattr(worker_config, "model_name", "") or ""
    if model_name and Path(model_name).is_dir():
        return Path(model_name)
    return None


def _tool_call_parser(settings: Settings, worker_config: Any) -> str | None:
    name = settings.tool_call_parser or getattr(worker_config, "tool_call_parser", None)
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool call parser '{name}'; supported: {', '.join(TOOL_CALL_PARSERS)}"
        )
    return name


def _reasoning_parser(settings: Settings, worker_config: Any) -> str | None:
    """``--reasoning-parser``, else the one the engine's ``WorkerConfig`` declares (as
    Dynamo's frontend reads ``--dyn-reasoning-parser``)."""
    name = settings.reasoning_parser or getattr(worker_config, "reasoning_parser", None)
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser '{name}'; supported: {', '.join(REASONING_PARSERS)}"
        )
    return name


async def build_gateway(
    settings: Settings, *, engine: Any = None, worker_config: Any = None
) -> Gateway:
    """Construct (unless given) and start the engine, and register what it serves.

    Raises on any failure, after the engine's partial state has been cleaned up.
    """
    if settings.ray and engine is None:
        return await _build_ray_gateway(settings)
    if engine is None:
        engine_cls = load_engine_class(settings.engine)
        engine, worker_config = await engine_cls.from_args(engine_argv(settings))
    host = build_host(settings, engine, worker_config)
    host.admission = AdmissionGate(
        settings.max_concurrency,
        settings.max_queue,
        settings.overload_status,
        shed_log_interval_s=settings.overload_log_interval_s,
    )
    started = time.monotonic()
    await host.start()
    try:
        gateway = _register_model(settings, host, worker_config)
        name = gateway.listed_models()[0].name
        await _bridge_engine_metrics(gateway, engine, name)
        await engine.on_endpoint_ready(
            Endpoint(
                namespace=getattr(worker_config, "namespace", "penstock"),
                component=getattr(worker_config, "component", "backend"),
                name=getattr(worker_config, "endpoint", "generate"),
                url=f"http://{settings.host}:{settings.port}",
            )
        )
    except BaseException:
        await host.cleanup()
        raise
    logger.info("engine ready in %.1fs: serving %s", time.monotonic() - started, name)
    return gateway


async def _build_ray_gateway(settings: Settings) -> Gateway:
    """The engine as a Ray Serve deployment (:mod:`penstock.ray`); this process the ingress."""
    from penstock.ray.fleet import start_fleet

    started = time.monotonic()
    host = await start_fleet(settings)
    try:
        gateway = _register_model(settings, host, host.worker_config)  # type: ignore[arg-type]
        gateway.fleet = host
    except BaseException:
        await host.cleanup()
        raise
    name = gateway.listed_models()[0].name
    logger.info("engine fleet ready in %.1fs: serving %s", time.monotonic() - started, name)
    return gateway


def _register_model(settings: Settings, host: EngineHost, worker_config: Any) -> Gateway:
    """The gateway around a started ``host``, with the model it serves registered."""
    gateway = Gateway(settings, host)
    endpoint_types = parse_endpoint_types(
        getattr(worker_config, "endpoint_types", None) or "chat,completions"
    )
    preprocessor = None
    folder = _tokenizer_folder(settings, worker_config)
    if folder is not None and not host.is_raw:
        preprocessor = Preprocessor.from_folder(folder)
    config = host.engine_config
    assert config is not None
    if settings.deterministic and not (config.runtime_data or {}).get(SUPPORTS_DETERMINISTIC):
        raise EngineLoadError(
            f"--deterministic: the {settings.engine} engine does not declare a deterministic "
            "mode (runtime_data['deterministic']); serve without --deterministic"
        )
    name = settings.served_model_name or host.served_model_name
    aliases = [a for a in [config.model, *config.model_aliases] if a and a != name]
    gateway.add_model(
        ServedModel(
            name=name,
            host=host,
            preprocessor=preprocessor,
            endpoint_types=endpoint_types,
            aliases=list(dict.fromkeys(aliases)),
            tool_call_parser=_tool_call_parser(settings, worker_config),
            reasoning_parser=_reasoning_parser(settings, worker_config),
        )
    )
    return gateway


async def _bridge_engine_metrics(gateway: Gateway, engine: Any, model: str) -> None:
    served = gateway.resolve(model)
    budget = served.token_budget
    gateway.metrics.set_token_limits(
        model,
        budget.combined_limit if budget is not None else served.context_length,
        reject_prompt=budget is None or budget.reject_prompt_overflow,
        reject_total=budget is None or budget.reject_total_overflow,
    )
    await bridge_engine_metrics(
        engine, gateway.host, gateway.engine_metrics, gateway.metrics.registry, model
    )


def freeze_imported_heap() -> None:
    """Leave every object that exists now (the modules imported so far, Penstock's, its
    libraries' and the engine's) out of the garbage collector's passes.

    They live as long as the process, yet each full pass walked all of them on the event
    loop, stalling every open stream: ~77,000 objects and 20-30 ms with the sample engine,
    every few thousand requests; ~250,000 and ~50 ms once torch and transformers are
    imported (``bench/gc_pauses.py``). Called before the engine starts, so its weights and
    everything built while serving stay collectable: a model dropped in a reference cycle
    (a level-2 sleep) is still freed by ``gc.collect()``.
    """
    gc.collect()
    gc.freeze()


class _DrainingServer(uvicorn.Server):
    """uvicorn with Penstock's shutdown: the first signal drains, a second exits at once.

    Draining answers new requests with 503 while in-flight ones finish, for at most the
    grace period; the requests still open then are cut (see
    :class:`~penstock.app.middleware.OpenRequests`), counted in ``requests_cut`` and
    summed up in one log line; then uvicorn stops and the engine is cleaned up.
    """

    def __init__(
        self, config: uvicorn.Config, gateway: Gateway, open_requests: OpenRequests
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.open_requests = open_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held so the running drain task is not garbage-collected.
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def requests_cut(self) -> int:
        return self.open_requests.requests_cut

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn announces the address only when it bound the socket itself.
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            logger.info("listening on http://%s:%d", shown, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gateway.draining:
            logger.warning("second signal: exiting now")
            os._exit(128 + sig)
        self.gateway.draining = True
        logger.info(
            "signal %s: draining (grace %.0fs)",
            signal.Signals(sig).name,
            self.gateway.settings.graceful_shutdown_s,
        )
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.gateway.settings.graceful_shutdown_s
        # The count lives in the middleware; polling it is simpler than signalling.
        while self.gateway.http_inflight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_DRAIN_POLL_S)
        if self.gateway.http_inflight > 0:
            tasks = self.open_requests.cut()
            if tasks:
                await asyncio.wait(tasks, timeout=_CUT_WAIT_S)
            cut = self.open_requests
            logger.warning(
                "grace period over: cut %d open requests, %d of them streams (each ended "
                "with a server_shutdown error frame and [DONE])",
                cut.requests_cut,
                cut.streams_cut,
            )
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` before the engine loads, so a busy port fails in seconds rather
    than after the model has loaded; uvicorn later listens on this very socket, so nothing
    can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol must be named: asyncio turns Nagle off (TCP_NODELAY) only on accepted
    # sockets whose proto is IPPROTO_TCP, and with Nagle on every small response waits
    # for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As uvicorn does: a restart may reuse a port whose old connections are in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = "the port is already in use"
        else:
            reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {host}:{port}: {reason}") from exc
    return sock


def warn_if_exposed(settings: Settings) -> None:
    """One WARNING when the inference routes are open to whoever can reach the port."""
    if settings.api_keys or _is_loopback(settings.host):
        return
    if settings.admin_api_keys:
        admin = "the admin routes need an admin key"
    else:
        admin = "the admin routes answer loopback clients only"
    logger.warning(
        "no --api-key set and listening on %s: anyone who can reach port %d can use the "
        "inference routes (%s)",
        settings.host,
        settings.port,
        admin,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop ``serve`` runs on: uvloop (asked, or ``auto`` where it is installed) cuts
    the loop's and the transports' own cost of every streamed chunk; None: asyncio's."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


async def serve(settings: Settings) -> int:
    """Run the gateway until a shutdown signal; the engine is always cleaned up.

    Returns how many requests were cut because the grace period ran out.
    """
    raise_open_file_limit(settings.max_connections)
    if settings.media_store:
        check_location(settings.media_store)
    check_database(settings.media_db)
    # Before the socket and the engine: a missing tracing extra fails in one line.
    tracing.install(settings)
    try:
        return await _serve(settings)
    finally:
        # Exports the spans still batched.
        tracing.shutdown()


async def _start_unless_stopped(settings: Settings) -> Gateway | None:
    """:func:`build_gateway`, or None once a SIGTERM arrives first: a supervisor may stop a
    server whose engine is still loading, and a default SIGTERM would end this process
    before it could clean up what the start made (a Ray cluster in a group of its own)."""
    loop = asyncio.get_running_loop()
    start = asyncio.ensure_future(build_gateway(settings))
    loop.add_signal_handler(signal.SIGTERM, start.cancel)
    try:
        return await start
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        return None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _serve(settings: Settings) -> int:
    sock = bind_socket(settings.host, settings.port)
    try:
        warn_if_exposed(settings)
        if not settings.ray:
            # Imported before the freeze: the engine's modules are frozen with the rest.
            load_engine_class(settings.engine)
        freeze_imported_heap()
        gateway = await _start_unless_stopped(settings)
        if gateway is None:
            logger.info("told to stop while the engine was starting; bye")
            return 0
        try:
            # The default store is named after the served model, known only now; a server
            # generating no media never writes there.
            if generates_media(gateway):
                check_location(media_store_location(settings, gateway.listed_models()[0].name))
            app = create_app(gateway)
            limits = ConnectionLimits(
                header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s,
                max_connections=settings.max_connections,
                body_deadline_s=settings.body_deadline_s,
            )
            config = uvicorn.Config(
                WireSend(app),
                http=guarded_protocol(limits),
                # No route is a WebSocket: the websockets library stays unloaded.
                ws="none",
                log_level=settings.log_level,
                # uvicorn's own lines go through the root handler, in the chosen format.
                log_config=None,
                timeout_graceful_shutdown=1,
                timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
                access_log=False,
            )
            server = _DrainingServer(config, gateway, app.state.open_requests)
            await server.serve(sockets=[sock])
            return server.requests_cut
        finally:
            await gateway.host.cleanup()
            logger.info("engine cleaned up; bye")
    finally:
        sock.close()
