"""The fleet update transaction without Ray: two sample engines behind a stand-in for
``DeploymentHandle.broadcast``; a deadline that cuts the update short rolls both back,
even where a replica's update finishes after the rollback was sent. Takes about 2 s."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from penstock.engines.samples.engine import SampleLLMEngine
from penstock.errors import ConflictError
from penstock.ray.adapters import FleetAdapters
from penstock.ray.fleet_admin import FleetEngine
from penstock.ray.replica_admin import ReplicaAdmin
from penstock.rl.state import AdminStateMachine


class Broadcast:
    """As in Serve, a replica's call runs on when the caller stops waiting for it."""

    def __init__(self, replicas: list[ReplicaAdmin], operation: str, args: tuple) -> None:
        self.calls = [asyncio.ensure_future(replica.run(operation, *args)) for replica in replicas]

    async def results_async(self, *, return_exceptions: bool) -> list[Any]:
        shielded = [asyncio.shield(call) for call in self.calls]
        return list(await asyncio.gather(*shielded, return_exceptions=return_exceptions))


class Handle:
    def __init__(self, replicas: list[ReplicaAdmin]) -> None:
        self.replicas = replicas
        self.calls: list[asyncio.Future[Any]] = []

    def broadcast(self, method: str, operation: str, *args: Any) -> Broadcast:
        assert method == "admin"
        sent = Broadcast(self.replicas, operation, args)
        self.calls.extend(sent.calls)
        return sent


@pytest.fixture
async def replicas() -> AsyncIterator[list[ReplicaAdmin]]:
    admins = []
    for name in ("replica-a", "replica-b"):
        engine, _ = await SampleLLMEngine.from_args(["--delay", "0"])
        await engine.start(0)
        admins.append(ReplicaAdmin(SimpleNamespace(engine=engine), name))  # type: ignore[arg-type]
    yield admins
    for admin in admins:
        await admin.host.engine.cleanup()


async def test_an_update_past_the_admin_deadline_rolls_every_replica_back(
    replicas: list[ReplicaAdmin],
) -> None:
    slow = replicas[1].host.engine
    update = slow.engine_update

    async def stalls(name: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(1.5)
        return await update(name, body)

    slow.engine_update = stalls
    handle = Handle(replicas)
    description = {"engine_class": "SampleLLMEngine", "updates": ["update_weights_from_tensor"]}
    fleet = FleetEngine(handle, description, FleetAdapters(handle, set(description["updates"])))
    fleet._controls = set(slow.supported_controls())
    state = AdminStateMachine(fleet, timeout_s=0.5)
    await state.pause("abort")
    body = {"named_tensors": {"token_shift": [4]}, "weight_version": "v1"}
    with pytest.raises(ConflictError) as raised:
        await state.update_weights("update_weights_from_tensor", body, "v1")
    assert raised.value.code == "admin_timeout"
    await asyncio.wait_for(asyncio.gather(*fleet._background), 10)
    # The stalled update too has ended by now: it must not land after the rollback.
    await asyncio.wait_for(asyncio.gather(*handle.calls), 10)
    for replica in replicas:
        engine = replica.host.engine
        assert (engine.weights.token_shift, engine.weight_version) == (0, None)
        assert replica.paused == "abort"
    assert state.weight_version is None and state.name == "paused"
