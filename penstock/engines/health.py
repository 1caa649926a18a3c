"""Health canary payloads and the engine health monitor configuration."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HEALTH_CHECK_KEY = "_HEALTH_CHECK"
HEALTH_CHECK_PAYLOAD_ENV = "DYN_HEALTH_CHECK_PAYLOAD"


def is_probe(request: dict[str, Any]) -> bool:
    """True only for canaries: the marker must be the boolean ``True``."""
    return request.get(HEALTH_CHECK_KEY) is True


def _stamp(payload: dict[str, Any]) -> dict[str, Any]:
    stamped = dict(payload)
    stamped[HEALTH_CHECK_KEY] = True
    return stamped


def _parse_json_or_file(value: str, source: str) -> Any:
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            logger.warning("%s: cannot read %s: %s", source, path, exc)
            return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        logger.warning("%s: not valid JSON: %s", source, exc)
        return None


def parse_health_check_payload_cli(value: str | None) -> dict[str, Any] | None:
    """Parse ``--health-check-payload``: JSON text or ``@path``; anything else -> None."""
    if not value:
        return None
    parsed = _parse_json_or_file(value, "--health-check-payload")
    if not isinstance(parsed, dict):
        if parsed is not None:
            logger.warning("--health-check-payload must be a JSON object; canary override ignored")
        return None
    return _stamp(parsed)


def load_health_check_from_env(name: str = HEALTH_CHECK_PAYLOAD_ENV) -> dict[str, Any] | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    parsed = _parse_json_or_file(value, name)
    return parsed if isinstance(parsed, dict) else None


def build_health_check_payload(
    bos_token_id: int, *, extras: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A one-token greedy canary; ``DYN_HEALTH_CHECK_PAYLOAD`` replaces it whole."""
    override = load_health_check_from_env()
    if override is not None:
        return _stamp(override)
    payload: dict[str, Any] = {
        "token_ids": [bos_token_id],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    if extras:
        payload.update(extras)
    return _stamp(payload)


def build_raw_health_check_payload(payload: dict[str, Any]) -> dict[str, Any]:
    override = load_health_check_from_env()
    return _stamp(override if override is not None else payload)


def bos_token_id_or(tokenizer: Any, default: int = 1) -> int:
    for holder in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        bos = getattr(holder, "bos_token_id", None)
        if isinstance(bos, int):
            return bos
    return default


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        logger.warning("%s=%r is not a number; using %s", name, raw, default)
        return default
    if not math.isfinite(value):
        logger.warning("%s=%r is not finite; using %s", name, raw, default)
        return default
    return max(value, 0.0)


@dataclass(frozen=True)
class EngineHealthMonitorConfig:
    """How often the idle canary runs, how long it may take, and the shutdown budget."""

    interval: float
    check_timeout: float
    shutdown_timeout: float

    @classmethod
    def from_env(
        cls,
        *,
        interval: float | None = None,
        check_timeout: float | None = None,
        shutdown_timeout: float | None = None,
    ) -> EngineHealthMonitorConfig:
        return cls(
            interval=interval
            if interval is not None
            else _env_seconds("DYN_ENGINE_HEALTH_CHECK_INTERVAL", 2.0),
            check_timeout=check_timeout
            if check_timeout is not None
            else _env_seconds("DYN_ENGINE_HEALTH_CHECK_TIMEOUT", 30.0),
            shutdown_timeout=shutdown_timeout
            if shutdown_timeout is not None
            else _env_seconds("DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT", 60.0),
        )
