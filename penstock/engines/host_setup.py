"""The :class:`EngineHost` the settings ask for, around an engine already constructed:
the single-process server and each Ray replica host their engine the same way."""

from __future__ import annotations

from typing import Any

from penstock.engines.health import load_health_check_from_env, parse_health_check_payload_cli
from penstock.engines.host import EngineHost
from penstock.engines.loading import refuse_disaggregated
from penstock.settings import Settings


def build_host(settings: Settings, engine: Any, worker_config: Any) -> EngineHost:
    """Refuses a disaggregated worker; the operator's canary (``--health-check-payload``,
    else the environment's) replaces the engine's."""
    refuse_disaggregated(worker_config)
    override = (
        parse_health_check_payload_cli(settings.health_check_payload)
        if settings.health_check_payload
        else load_health_check_from_env()
    )
    return EngineHost(engine, worker_config, health_check_override=override)
