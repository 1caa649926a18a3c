"""Build the FastAPI application around a started :class:`Gateway`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from types import ModuleType

from fastapi import Depends, FastAPI

from penstock import __version__
from penstock.app.handlers import install_error_handlers
from penstock.app.middleware import GatewayMiddleware
from penstock.gateway import Gateway
from penstock.routers import (
    admin,
    chat,
    completions,
    health,
    images,
    lora,
    metrics,
    models,
    sglang_compat,
    tokenize,
    videos,
    vllm_compat,
)
from penstock.routers.security import require_inference_key

logger = logging.getLogger(__name__)

# Each module exposes ``router`` and may define ``async on_startup(gateway)`` /
# ``async on_shutdown(gateway)``; they run in this order (shutdown in reverse).
ROUTER_MODULES: list[ModuleType] = [
    health,
    metrics,
    models,
    chat,
    completions,
    tokenize,
    admin,
    lora,
    sglang_compat,
    vllm_compat,
    videos,
    images,
]

ALWAYS_OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})


def create_app(gateway: Gateway) -> FastAPI:
    """The HTTP surface of ``gateway``; the engine must already be started."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started: list[ModuleType] = []
        try:
            for module in ROUTER_MODULES:
                hook = getattr(module, "on_startup", None)
                if hook is not None:
                    await hook(gateway)
                started.append(module)
            gateway.host.start_monitor()
            yield
        finally:
            await gateway.host.stop_monitor()
            for module in reversed(started):
                hook = getattr(module, "on_shutdown", None)
                if hook is not None:
                    try:
                        await hook(gateway)
                    except Exception:
                        logger.exception("shutdown hook of %s failed", module.__name__)

    app = FastAPI(
        title="Penstock",
        version=__version__,
        lifespan=lifespan,
        dependencies=[Depends(require_inference_key)],
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    for module in ROUTER_MODULES:
        app.include_router(module.router)
    app.add_middleware(GatewayMiddleware, gateway=gateway, always_open_paths=ALWAYS_OPEN_PATHS)
    return app
