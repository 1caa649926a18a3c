"""The admin plane of one gateway: state machine, LoRA adapters and RL route registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from penstock.engines.host import EngineState
from penstock.lora.adapters import LoadedAdapters
from penstock.rl.admin import RLRouteRegistry
from penstock.rl.routes import RLRoutes
from penstock.rl.state import AdminStateMachine
from penstock.rl.weights import WeightsChecker

if TYPE_CHECKING:
    from penstock.gateway import Gateway


class GatewayRuntime:
    """What the RL registry asks of its runtime: where the admin routes are reached."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def system_status_server_url(self) -> str:
        settings = self.gateway.settings
        return f"http://{settings.host}:{settings.port}/engine"


@dataclass
class AdminPlane:
    state: AdminStateMachine
    adapters: LoadedAdapters
    registry: RLRouteRegistry
    checker: WeightsChecker


async def install_admin_plane(gateway: Gateway) -> AdminPlane:
    """Build the plane, read the engine's current weight version and attach it all."""
    engine = gateway.host.engine

    def publish(version: str | None) -> None:
        gateway.weight_version = version

    initial = gateway.weight_version
    if "get_weight_version" in engine.supported_controls():
        reported = await engine.engine_control("get_weight_version", {})
        if isinstance(reported, dict) and isinstance(reported.get("weight_version"), str):
            initial = reported["weight_version"]
    state = AdminStateMachine(
        engine,
        is_draining=lambda: gateway.draining,
        publish_version=publish,
        weight_version=initial,
        timeout_s=gateway.settings.admin_timeout_s,
        metrics=gateway.admin_metrics,
        trust_weight_payloads=gateway.settings.trust_weight_payloads,
    )
    gateway.weight_version = initial
    adapters = LoadedAdapters(gateway, state)
    registry = RLRouteRegistry(GatewayRuntime(gateway))
    checker = WeightsChecker(state)
    routes = RLRoutes(
        state, adapters, checker, alive=lambda: gateway.host.state is EngineState.RUNNING
    )
    registry.add_routes(routes.handlers())
    plane = AdminPlane(state, adapters, registry, checker)
    gateway.admin = state
    return plane
