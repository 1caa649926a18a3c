"""The served models of one gateway process and its readiness."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from penstock import __version__
from penstock.engines.host import EngineHost
from penstock.engines.token_budget import TOKEN_BUDGET_RUNTIME_KEY, TokenBudget
from penstock.errors import ModelNotFoundError
from penstock.metrics.admin import AdminMetrics
from penstock.metrics.engine_bridge import EngineMetrics
from penstock.metrics.frontend import FrontendMetrics
from penstock.metrics.media import MediaMetrics
from penstock.preprocess.offload import PreprocessPool
from penstock.settings import Settings

if TYPE_CHECKING:
    from penstock.preprocess import Preprocessor

logger = logging.getLogger(__name__)


class AdminStateView(Protocol):
    """What the gateway needs to know of the admin plane's state machine."""

    @property
    def name(self) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class FleetView(Protocol):
    """A fleet of engine replicas behind this gateway (``--ray``), as ``/health`` shows it."""

    def describe_fleet(self) -> dict[str, Any]: ...

    async def metrics_text(self) -> str:
        """Every replica's metrics, each series labelled with its replica."""
        ...


@dataclass
class ServedModel:
    """One name clients can put in ``model``, and what serves it."""

    name: str
    host: EngineHost
    preprocessor: Preprocessor | None
    endpoint_types: set[str]
    aliases: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    lora_adapter: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def context_length(self) -> int | None:
        config = self.host.engine_config
        if config is None or config.llm is None:
            return None
        return config.llm.context_length

    @property
    def token_budget(self) -> TokenBudget | None:
        """The engine's advertised ``TokenBudget``, if any (a dict or, as Dynamo publishes
        it, its JSON text, under ``runtime_data["token_budget"]``)."""
        config = self.host.engine_config
        return token_budget_of(config.runtime_data if config is not None else None)


def token_budget_of(runtime_data: dict[str, Any] | None) -> TokenBudget | None:
    """Read a ``TokenBudget`` back; one that does not parse is ignored, with a warning."""
    advertised = (runtime_data or {}).get(TOKEN_BUDGET_RUNTIME_KEY)
    if advertised is None:
        return None
    try:
        fields = json.loads(advertised) if isinstance(advertised, str) else advertised
        return TokenBudget(
            combined_limit=fields["combined_limit"],
            reject_prompt_overflow=bool(fields["reject_prompt_overflow"]),
            reject_total_overflow=bool(fields["reject_total_overflow"]),
        )
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring the engine's token budget %r: %s", advertised, exc)
        return None


@dataclass
class Readiness:
    ready: bool
    status: str
    reason: str | None = None


def system_fingerprint(settings: Settings) -> str:
    """The ``system_fingerprint`` of every generation answer: Penstock's version and a
    digest of what decides its outputs (engine, model, engine arguments), constant for the
    server's life as vLLM's is, so a client can tell two backends apart."""
    served = json.dumps([__version__, settings.engine, settings.model, settings.engine_args])
    return f"penstock-{__version__}-{hashlib.sha256(served.encode()).hexdigest()[:8]}"


class Gateway:
    """Holds the engine host, the served models and process-wide serving state."""

    def __init__(self, settings: Settings, host: EngineHost) -> None:
        self.settings = settings
        self.system_fingerprint = system_fingerprint(settings)
        self.host = host
        self.models: dict[str, ServedModel] = {}
        self.draining = False
        self.http_inflight = 0
        self.admin: AdminStateView | None = None
        self.fleet: FleetView | None = None
        self.weight_version: str | None = None
        self.metrics = FrontendMetrics()
        self.engine_metrics = EngineMetrics()
        self.admin_metrics = AdminMetrics(self.metrics.registry)
        self.admin_metrics.watch(self._admin_state, lambda: self.weight_version)
        self.media_metrics = MediaMetrics(self.metrics.registry)
        self.preprocess = PreprocessPool(settings.preprocess_workers)

    def add_model(self, model: ServedModel) -> None:
        for name in (model.name, *model.aliases):
            self.models[name] = model

    def remove_model(self, name: str) -> None:
        model = self.models.get(name)
        if model is None:
            return
        for key in (model.name, *model.aliases):
            self.models.pop(key, None)

    def resolve(self, name: Any) -> ServedModel:
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            raise ModelNotFoundError(str(name))
        return model

    def listed_models(self) -> list[ServedModel]:
        """Each served model once, in registration order."""
        seen: dict[int, ServedModel] = {}
        for model in self.models.values():
            seen.setdefault(id(model), model)
        return list(seen.values())

    def _admin_state(self) -> str:
        if self.admin is not None:
            return self.admin.name
        return "draining" if self.draining else "serving"

    def readiness(self) -> Readiness:
        if self.draining:
            return Readiness(False, "draining", "the server is shutting down")
        if self.admin is not None and self.admin.name != "serving":
            return Readiness(False, self.admin.name, f"engine is {self.admin.name}")
        if not self.host.health.healthy:
            return Readiness(False, "unhealthy", self.host.health.reason)
        return Readiness(True, "healthy")
