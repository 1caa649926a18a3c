"""Random concurrent admin calls over live streams never wedge the admin plane.

Each example starts an in-process gateway on the sample engine, starts streams, and fires
rounds of concurrent admin calls (pause in each mode, resume, sleep, wake-up, flush,
version and weight updates, through all three dialects). Every call must answer 200 or
409-with-the-state within a client timeout; the state the gateway reports must match the
engine's own; after a final wake-up and resume it is ``serving``; and every stream ends
with one ``finish_reason`` and ``[DONE]``: ``length``, or ``abort`` for requests an
abort-mode pause or sleep ended.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from penstock.engines.samples.engine import write_sample_weights
from penstock.gateway import Gateway
from tests.support.inprocess import asgi_client, start_gateway

MODEL = "sample-model"
ADMIN_TIMEOUT_S = 1.0
# Long streams outlast the admin timeout, so wait-mode calls over them overrun too.
TOKEN_DELAY_S = 0.005
# An admin call answers within the admin timeout, plus at most as long again to undo an
# overrun; the rest is slack for a busy machine. Only a hang takes longer.
CALL_TIMEOUT_S = 5 * ADMIN_TIMEOUT_S
STREAM_TIMEOUT_S = 20.0
STATES = {"serving", "paused", "sleeping", "updating"}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.body or ''}".strip()


def admin_calls(weights: Path) -> st.SearchStrategy[Call]:
    modes = ("abort", "wait", "keep")
    pauses = [Call("POST", f"/pause?mode={mode}") for mode in modes] + [
        Call("POST", "/engine/pause_generation", {"mode": mode}) for mode in modes
    ]
    sleeps = [Call("POST", f"/sleep?mode={mode}") for mode in modes] + [
        Call("POST", "/engine/control/sleep", {"level": 0, "mode": "wait"}),
        Call("POST", "/release_memory_occupation", {}),
    ]
    # Freezing requests, then sleeping or draining over them, is where a wait can hang:
    # those calls come up more often than the rest.
    keep_pauses = [
        Call("POST", "/pause?mode=keep"),
        Call("POST", "/pause_generation", {"mode": "retract"}),
    ]
    others = [
        Call("POST", "/resume"),
        Call("POST", "/continue_generation", {}),
        Call("POST", "/engine/resume_generation"),
        Call("POST", "/wake_up"),
        Call("POST", "/wake_up?tags=weights"),
        Call("POST", "/resume_memory_occupation", {}),
        Call("POST", "/flush_cache"),
        Call("POST", "/reset_prefix_cache"),
        Call("POST", "/update_weight_version", {"new_version": "v1"}),
        Call("POST", "/engine/set_weight_version", {"weight_version": "v2"}),
        Call("POST", "/engine/update_weights_from_disk", {"model_path": str(weights)}),
        Call("POST", "/update_weights_from_disk", {"model_path": str(weights)}),
    ]
    return st.sampled_from(pauses + 2 * keep_pauses + 2 * sleeps + others)


def may_abort(admin: Call) -> bool:
    return "mode=abort" in admin.path or (admin.body or {}).get("mode") == "abort"


@dataclass
class Ended:
    finish_reasons: list[str]
    done: bool


async def stream(client: httpx.AsyncClient, max_tokens: int) -> Ended:
    body = {
        "model": MODEL,
        "prompt": "rollout",
        "max_tokens": max_tokens,
        "stream": True,
    }
    response = await asyncio.wait_for(client.post("/v1/completions", json=body), STREAM_TIMEOUT_S)
    assert response.status_code == 200, response.text
    reasons: list[str] = []
    done = False
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        for choice in json.loads(data).get("choices", []):
            if choice.get("finish_reason") is not None:
                reasons.append(choice["finish_reason"])
    return Ended(reasons, done)


async def call(client: httpx.AsyncClient, admin: Call) -> httpx.Response:
    try:
        response = await asyncio.wait_for(
            client.request(admin.method, admin.path, json=admin.body), CALL_TIMEOUT_S
        )
    except TimeoutError:
        pytest.fail(f"admin call hung: {admin}")
    assert response.status_code in (200, 409), (str(admin), response.text)
    if response.status_code == 409:
        # "updating" when a call found the lock held by a weight update.
        assert response.json()["error"]["state"] in STATES, (str(admin), response.text)
    return response


async def assert_matches_engine(client: httpx.AsyncClient, gateway: Gateway) -> dict[str, Any]:
    """The state the gateway reports is the engine's own."""
    state = (await call(client, Call("GET", "/engine/capabilities"))).json()["state"]
    engine = gateway.host.engine
    paused = await engine.engine_control("is_paused", {})
    sleeping = await engine.engine_control("is_sleeping", {})
    assert paused["is_paused"] == (state["mode"] is not None), state
    assert sleeping["tags"] == state["tags"], state
    return state


Round = tuple[float, list[Call]]


async def scenario(weights: Path, streams: list[int], rounds: list[Round], late: list[int]) -> None:
    gateway = await start_gateway(
        admin_timeout_s=ADMIN_TIMEOUT_S, engine_args=["--delay", str(TOKEN_DELAY_S)]
    )
    try:
        async for client in asgi_client(gateway):
            running = [asyncio.create_task(stream(client, n)) for n in streams]
            aborting = False
            for index, (gap, admin_round) in enumerate(rounds):
                if index < len(late):
                    running.append(asyncio.create_task(stream(client, late[index])))
                # Lets streams reach the engine (or not) before the round: where they are
                # when it lands varies from round to round.
                await asyncio.sleep(gap)
                answers = await asyncio.gather(*(call(client, admin) for admin in admin_round))
                aborting |= any(
                    may_abort(admin) and answer.status_code == 200
                    for admin, answer in zip(admin_round, answers, strict=True)
                )
                await assert_matches_engine(client, gateway)

            await call(client, Call("POST", "/wake_up"))
            await call(client, Call("POST", "/resume"))
            state = await assert_matches_engine(client, gateway)
            assert state["state"] == "serving" and state["tags"] == [], state

            ended = await asyncio.wait_for(asyncio.gather(*running), STREAM_TIMEOUT_S)
            # Only an abort-mode pause or sleep may end a request early.
            endings = ("length", "abort") if aborting else ("length",)
            for result in ended:
                assert result.done and len(result.finish_reasons) == 1, result
                assert result.finish_reasons[0] in endings, result
            after = await stream(client, 3)
            assert after.done and after.finish_reasons == ["length"]
    finally:
        await gateway.host.cleanup()


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weights")
    write_sample_weights(folder, 3)
    return folder


def test_random_concurrent_admin_calls_never_wedge_or_lose_a_request(weights: Path) -> None:
    token_counts = st.integers(min_value=5, max_value=400)

    @settings(
        max_examples=12,
        deadline=None,
        database=None,
        # A failing example costs a few seconds; shrinking it would take minutes.
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        streams=st.lists(token_counts, min_size=1, max_size=4),
        rounds=st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.02, 0.1]),
                st.lists(admin_calls(weights), min_size=1, max_size=4),
            ),
            min_size=1,
            max_size=4,
        ),
        late=st.lists(token_counts, max_size=3),
    )
    # The reported wedge: a stream frozen by a keep pause, then SGLang's sleep.
    @example(
        streams=[400],
        rounds=[
            (0.1, [Call("POST", "/pause?mode=keep")]),
            (0.0, [Call("POST", "/release_memory_occupation", {}), Call("POST", "/resume")]),
        ],
        late=[5],
    )
    def run(streams: list[int], rounds: list[Round], late: list[int]) -> None:
        asyncio.run(scenario(weights, streams, rounds, late))

    run()
