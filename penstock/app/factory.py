"""Build the FastAPI application around a started :class:`Gateway`."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_fastapi_instrumentator.routing import get_route_name
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from penstock import __version__
from penstock.app.handlers import install_error_handlers
from penstock.app.hot import HotRoute, HotRoutes, hot_routes
from penstock.app.middleware import GatewayMiddleware, OpenRequests
from penstock.gateway import Gateway
from penstock.http import create_http_client
from penstock.media.artifacts import in_memory, local_folder
from penstock.media.records import is_database_url
from penstock.media.requests import generates_media
from penstock.media.service import MediaService
from penstock.metrics.http import HttpMetricsMiddleware
from penstock.multimodal.inputs import MediaInputs
from penstock.ray.replica_header import ReplicaHeader
from penstock.responses.async_store import AsyncResponseStore
from penstock.rl.plane import install_admin_plane
from penstock.routers import (
    admin,
    chat,
    completions,
    embeddings,
    generate,
    health,
    images,
    lora,
    metrics,
    models,
    responses,
    sglang_compat,
    tokenize,
    trainer_compat,
    videos,
    vllm_compat,
)
from penstock.routers.hot import HOT_ROUTERS
from penstock.routers.security import require_inference_key
from penstock.settings import Settings
from penstock.tracing import active as active_tracing

if TYPE_CHECKING:
    from penstock.tracing.otel import Tracing

ALWAYS_OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
# Every router of the app, in the order their routes are matched.
ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    metrics.router,
    models.router,
    chat.router,
    responses.router,
    completions.router,
    generate.router,
    tokenize.router,
    embeddings.router,
    admin.router,
    lora.router,
    sglang_compat.router,
    vllm_compat.router,
    trainer_compat.router,
    videos.router,
    images.router,
)
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")

logger = logging.getLogger(__name__)


def filesystem_name(name: str) -> str:
    """``name`` as one path component: runs of other characters than letters, digits,
    ``.``, ``_`` and ``-`` become ``_``, and it never starts with a dot."""
    return _UNSAFE_RUN.sub("_", name).lstrip(".") or "_"


def media_store_location(settings: Settings, model: str) -> str:
    """``media_store``, else a folder per served model under the cache folder, so servers
    of different models under one cache folder never list each other's jobs."""
    return settings.media_store or str(Path(settings.cache_dir) / "media" / filesystem_name(model))


def job_db_path(settings: Settings, store: str, model: str) -> Path | str | None:
    """Next to the media files when they are local (a store folder is then
    self-contained); in memory (None) for an in-memory store, whose jobs would outlive
    their files anywhere else; in the cache folder, one per served model, otherwise;
    ``media_db`` overrides them all: a file path, or a database URL (kept a string)."""
    override = (settings.media_db or "").strip()
    if is_database_url(override):
        return override
    if override:
        return Path(override)
    if in_memory(store):
        return None
    folder = local_folder(store)
    if folder is not None:
        return folder / "jobs.sqlite3"
    return Path(settings.cache_dir) / "media-jobs" / f"{filesystem_name(model)}.sqlite3"


def response_db_path(gateway: Gateway) -> Path | str | None:
    """The database of stored responses: the media job database's, a table of its own."""
    settings = gateway.settings
    model = gateway.listed_models()[0].name
    return job_db_path(settings, media_store_location(settings, model), model)


def open_media_service(gateway: Gateway) -> MediaService | None:
    """The media service (job store, artifact store, workers) of a server whose models
    generate media; None otherwise: no job database is opened, nor SQLAlchemy imported,
    and the media routes find no jobs (:func:`penstock.routers.deps.media_jobs`)."""
    if not generates_media(gateway):
        return None
    settings = gateway.settings
    model = gateway.listed_models()[0].name
    store = media_store_location(settings, model)
    db_path = job_db_path(settings, store, model)
    media = MediaService(
        gateway,
        store=store,
        db_path=db_path,
        workers=settings.media_workers,
        lease_s=settings.media_job_lease_s,
    )
    # A URL is logged without its password.
    where = db_path if isinstance(db_path, Path) else media.jobs.url if db_path else "memory"
    logger.info("video jobs kept in %s, generated media in %s", where, store)
    return media


class GatewayApp(FastAPI):
    """FastAPI inside Penstock's middlewares rather than around them.

    FastAPI wraps its routes in layers of its own (the server-error page, its telemetry
    and body limit, the exception handlers); here Penstock's middlewares
    (:attr:`middlewares`) go around all of that, so the hot inference routes, which the
    innermost of them serves, pass none of FastAPI's layers: a coroutine frame fewer per
    layer on every chunk, about 2 kB less per open stream. Every other route goes through
    FastAPI's layers as before. An exception a hot route lets escape after its response
    began ends the connection as the server ends any failed response. An HTTP request
    enters the stack here, without passing FastAPI's and Starlette's ``__call__`` (FastAPI's
    own telemetry is off, so they only set what this sets): two coroutine frames fewer
    held by every open stream.
    """

    middlewares: Callable[[ASGIApp], ASGIApp] | None = None

    def build_middleware_stack(self) -> ASGIApp:
        fastapi_layers = super().build_middleware_stack()
        if self.middlewares is None:
            return fastapi_layers
        return self.middlewares(fastapi_layers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stack = self.middleware_stack
        if stack is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if self.root_path:
            scope["root_path"] = self.root_path
        scope["app"] = self
        await stack(scope, receive, send)


def _fastapi_telemetry_off() -> dict[str, Any]:
    """The keyword that turns FastAPI's own telemetry off, where it has one (0.142 and
    later; vLLM 0.32 holds FastAPI below 0.137)."""
    if importlib.util.find_spec("fastapi.telemetry") is None:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def create_app(gateway: Gateway) -> FastAPI:
    """The HTTP surface of ``gateway``; the engine must already be started.

    Every router, every service and every startup and shutdown step is here, in order.
    Routes reach the services through :mod:`penstock.routers.deps`.
    """
    settings = gateway.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.admin_plane = await install_admin_plane(gateway)
        media = app.state.media = open_media_service(gateway)
        app.state.responses = AsyncResponseStore(functools.partial(response_db_path, gateway))
        # One client for every media fetch of the server: its connection pool is shared.
        http_client = create_http_client(settings)
        app.state.media_inputs = MediaInputs.from_settings(settings, http_client)
        try:
            if media is not None:
                media.start()
            gateway.host.start_monitor()
            _resolve_routes(app)
            yield
        finally:
            await gateway.host.stop_monitor()
            if media is not None:
                await media.stop()
            await http_client.close()
            app.state.responses.close()

    # FastAPI's own doc pages skip the app's dependencies, so unless they are public the
    # same pages are added as ordinary routes, which the inference key guards.
    public = settings.public_docs
    app = GatewayApp(
        title="Penstock",
        version=__version__,
        lifespan=lifespan,
        dependencies=[Depends(require_inference_key)],
        openapi_url="/openapi.json" if public else None,
        docs_url="/docs" if public else None,
        redoc_url="/redoc" if public else None,
        # Penstock traces requests itself (``--otlp-endpoint``); FastAPI's telemetry would
        # look up the global OpenTelemetry providers on every request.
        **_fastapi_telemetry_off(),
    )
    if not public:
        _add_keyed_docs(app)
    app.state.gateway = gateway
    # The server cuts what is still open when the grace period of a shutdown ends.
    app.state.open_requests = OpenRequests()
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    hot = hot_routes([route for router in HOT_ROUTERS for route in router.routes], settings)
    app.middlewares = functools.partial(
        _middlewares,
        gateway=gateway,
        hot=hot,
        open_requests=app.state.open_requests,
        tracing=active_tracing(),
    )
    return app


def _middlewares(
    fastapi_layers: ASGIApp,
    *,
    gateway: Gateway,
    hot: dict[tuple[str, str], HotRoute],
    open_requests: OpenRequests,
    tracing: Tracing | None,
) -> ASGIApp:
    """Penstock's middlewares around FastAPI's layers, innermost first."""
    # Innermost: the hot operations, served without any of FastAPI's layers.
    wrapped: ASGIApp = HotRoutes(fastapi_layers, routes=hot)
    if gateway.settings.ray:
        # Which replica served each answer: a fleet's only (penstock.ray.replica_header).
        wrapped = ReplicaHeader(wrapped)
    if tracing is not None:
        # Inside the gateway middleware: the request id is known when the span starts.
        from penstock.tracing.otel import TracingMiddleware

        wrapped = TracingMiddleware(
            wrapped,
            tracing=tracing,
            skip_paths=ALWAYS_OPEN_PATHS,
            weight_version=lambda: gateway.weight_version,
        )
    wrapped = GatewayMiddleware(
        wrapped,
        gateway=gateway,
        always_open_paths=ALWAYS_OPEN_PATHS,
        open_requests=open_requests,
    )
    # Outermost, so refusals of the gateway middleware (413, 503 while draining) count.
    return HttpMetricsMiddleware(wrapped, registry=gateway.metrics.registry)


def _resolve_routes(app: FastAPI) -> None:
    """FastAPI resolves what each included route inherits on first use, ~30 ms for this
    app; doing it before the socket opens spares the first request that wait."""
    scope = {"type": "http", "app": app, "method": "GET", "path": "/", "root_path": ""}
    get_route_name(Request({**scope, "headers": [], "query_string": b""}), False)


def _add_keyed_docs(app: FastAPI) -> None:
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
