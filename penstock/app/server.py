"""Start an engine, serve it over HTTP, drain and clean up on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from penstock.app.factory import create_app
from penstock.engines.admission import AdmissionGate
from penstock.engines.contract import parse_endpoint_types
from penstock.engines.health import load_health_check_from_env, parse_health_check_payload_cli
from penstock.engines.host import EngineHost
from penstock.engines.loading import load_engine_class
from penstock.errors import ListenError
from penstock.gateway import Gateway, ServedModel
from penstock.media.artifacts import check_location
from penstock.metrics.engine_bridge import SnapshotPublisher
from penstock.preprocess import Preprocessor
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import Settings

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class Endpoint:
    """What ``on_endpoint_ready`` receives: where the engine is being served."""

    namespace: str
    component: str
    name: str
    url: str


def engine_argv(settings: Settings) -> list[str]:
    """The engine's own arguments: ``--model`` is forwarded, then everything after ``--``."""
    argv = list(settings.engine_args)
    if settings.model:
        argv = ["--model", settings.model, *argv]
    return argv


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


async def build_gateway(
    settings: Settings, *, engine: Any = None, worker_config: Any = None
) -> Gateway:
    """Construct (unless given) and start the engine, and register what it serves.

    Raises on any failure, after the engine's partial state has been cleaned up.
    """
    if engine is None:
        engine_cls = load_engine_class(settings.engine)
        engine, worker_config = await engine_cls.from_args(engine_argv(settings))
    override = (
        parse_health_check_payload_cli(settings.health_check_payload)
        if settings.health_check_payload
        else load_health_check_from_env()
    )
    host = EngineHost(engine, worker_config, health_check_override=override)
    host.admission = AdmissionGate(
        settings.max_concurrency,
        settings.max_queue,
        settings.overload_status,
        shed_log_interval_s=settings.overload_log_interval_s,
    )
    started = time.monotonic()
    await host.start()
    try:
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
            )
        )
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


async def _bridge_engine_metrics(gateway: Gateway, engine: Any, model: str) -> None:
    await engine.register_prometheus(gateway.engine_metrics)
    ranks = list(engine.component_metrics_dp_ranks())
    if ranks:
        engine.attach_snapshot_publisher(SnapshotPublisher(ranks, model, gateway.metrics.registry))


class _DrainingServer(uvicorn.Server):
    """uvicorn with Penstock's shutdown: the first signal drains, a second exits at once.

    Draining answers new requests with 503 while in-flight ones finish, for at most the
    grace period; then uvicorn stops and the engine is cleaned up.
    """

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held so the running drain task is not garbage-collected.
        self._drain_task: asyncio.Task[None] | None = None

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
            logger.warning("grace period over with %d requests open", self.gateway.http_inflight)
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


async def serve(settings: Settings) -> None:
    """Run the gateway until a shutdown signal; the engine is always cleaned up."""
    if settings.media_store:
        check_location(settings.media_store)
    sock = bind_socket(settings.host, settings.port)
    try:
        gateway = await build_gateway(settings)
        try:
            config = uvicorn.Config(
                create_app(gateway),
                log_level=settings.log_level,
                # uvicorn's own lines go through the root handler, in the chosen format.
                log_config=None,
                timeout_graceful_shutdown=1,
                access_log=False,
            )
            await _DrainingServer(config, gateway).serve(sockets=[sock])
        finally:
            await gateway.host.cleanup()
            logger.info("engine cleaned up; bye")
    finally:
        sock.close()
