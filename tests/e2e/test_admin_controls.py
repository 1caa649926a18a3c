"""The controls trainers send, against real servers: every sequence of sleep and wake
calls that ends awake leaves the engine generating, and an abort of all requests ends the
streams in flight with ``finish_reason`` ``"abort"`` and what they had produced.

Sleep and wake go through both dialects (SGLang ``release_memory_occupation`` /
``resume_memory_occupation`` with tags, vLLM ``sleep`` levels 0-2 / ``wake_up`` tags),
drawn by hypothesis: broadly on the sample engine, a few sequences on the tiny
transformers checkpoint. After each call the admin state names the tags still released,
and once none is, a completion runs to its end and the weights can be read again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from penstock.engines.controls import SLEEP_TAGS, default_sleep_tags
from tests.support.server import ServerProcess, running_server
from tests.support.tiny_llm import build_tiny_llama

SAMPLE_MODEL = "sample-model"
CLIENT_TIMEOUT_S = 60.0
# Far more tokens than a stream produces before the abort that follows its first one.
LONG_STREAM_TOKENS = 480


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    model: str


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    args = ["--engine", "sample", "--", "--delay", "0.001"]
    with running_server(args, tmp_path_factory.mktemp("sample-controls")) as server:
        yield Served(server, SAMPLE_MODEL)


@pytest.fixture(scope="module")
def transformers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    args = [
        "--engine",
        "transformers",
        "--model",
        str(model_dir),
        "--",
        "--cpu-threads",
        "1",
        "--max-num-seqs",
        "4",
    ]
    with running_server(
        args,
        tmp_path_factory.mktemp("transformers-controls"),
        env={"HF_HUB_OFFLINE": "1"},
        ready_timeout=120,
    ) as server:
        yield Served(server, str(model_dir))


@dataclass(frozen=True)
class Call:
    """One sleep or wake call, and the tags it releases (sleep) or restores (wake)."""

    path: str
    body: dict[str, Any]
    sleeps: bool
    tags: frozenset[str]

    def __repr__(self) -> str:
        return f"POST {self.path} {self.body}"


TAG_SETS = st.sampled_from([None, ["kv_cache"], ["weights"], ["kv_cache", "weights"]])


@st.composite
def sleep_call(draw: st.DrawFn) -> Call:
    tags = draw(TAG_SETS)
    if draw(st.booleans()):
        body = {} if tags is None else {"tags": tags}
        return Call("/release_memory_occupation", body, True, frozenset(tags or SLEEP_TAGS))
    level = draw(st.sampled_from([0, 1, 2]))
    body = {} if tags is None else {"tags": tags}
    released = frozenset(tags) if tags is not None else default_sleep_tags(level)
    return Call(f"/sleep?level={level}", body, True, released)


@st.composite
def wake_call(draw: st.DrawFn) -> Call:
    tags = draw(TAG_SETS)
    path = draw(st.sampled_from(["/resume_memory_occupation", "/wake_up"]))
    body = {} if tags is None else {"tags": tags}
    return Call(path, body, False, frozenset(tags or SLEEP_TAGS))


def final_wake(released: frozenset[str], sglang: bool) -> Call:
    path = "/resume_memory_occupation" if sglang else "/wake_up"
    return Call(path, {"tags": sorted(released)}, False, released)


SEQUENCES = st.tuples(
    st.lists(st.one_of(sleep_call(), wake_call()), min_size=1, max_size=5), st.booleans()
)


def admin_state(client: httpx.Client) -> dict[str, Any]:
    state: dict[str, Any] = client.get("/engine/capabilities").json()["state"]
    return state


def run_sequence(served: Served, calls: list[Call], sglang_wake: bool) -> None:
    """Each call answers 200 and leaves the state the tags say; awake, the engine serves."""
    released: frozenset[str] = frozenset()
    with httpx.Client(base_url=served.server.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        steps = list(calls)
        for call in steps:
            answer = client.post(call.path, json=call.body)
            assert answer.status_code == 200, (call, answer.text)
            released = released | call.tags if call.sleeps else released - call.tags
            state = admin_state(client)
            assert state["tags"] == sorted(released), (call, state)
            assert state["state"] == ("sleeping" if released else "serving"), (call, state)
        if released:
            call = final_wake(released, sglang_wake)
            answer = client.post(call.path, json=call.body)
            assert answer.status_code == 200, (call, answer.text)
            assert admin_state(client)["state"] == "serving"
        checked = client.post("/weights_checker", json={"action": "checksum"})
        assert checked.status_code == 200 and checked.json()["success"] is True, checked.text
    completion = openai.OpenAI(
        base_url=f"{served.server.base_url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT_S
    ).completions.create(
        model=served.model, prompt="after the sleep", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 4


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=SEQUENCES)
def test_sleep_and_wake_sequences_leave_the_sample_engine_serving(
    sample: Served, sequence: tuple[list[Call], bool]
) -> None:
    run_sequence(sample, *sequence)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=SEQUENCES)
def test_sleep_and_wake_sequences_leave_the_transformers_engine_serving(
    transformers: Served, sequence: tuple[list[Call], bool]
) -> None:
    run_sequence(transformers, *sequence)


def test_a_level_0_sleep_woken_by_its_kv_cache_tag_serves_on_transformers(
    transformers: Served,
) -> None:
    """The sequence that once left the engine asleep under an ``awake`` answer."""
    sleep = Call("/sleep?level=0", {}, True, frozenset({"kv_cache"}))
    wake = Call("/wake_up", {"tags": ["kv_cache"]}, False, frozenset({"kv_cache"}))
    run_sequence(transformers, [sleep, wake], sglang_wake=False)


@dataclass
class StreamRead:
    content: str = ""
    finish_reason: str | None = None


async def read_stream(
    client: openai.AsyncOpenAI, model: str, prompt: str, first: asyncio.Event
) -> StreamRead:
    read = StreamRead()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=LONG_STREAM_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            read.content += choice.delta.content or ""
            if read.content:
                first.set()
            if choice.finish_reason is not None:
                read.finish_reason = choice.finish_reason
    return read


@pytest.mark.parametrize(
    ("path", "body"),
    [("/abort_request", {"abort_all": True}), ("/abort_requests", {})],
    ids=["sglang", "vllm"],
)
async def test_abort_all_ends_in_flight_streams_with_abort_on_transformers(
    transformers: Served, path: str, body: dict[str, Any]
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{transformers.server.base_url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT_S
    )
    started = [asyncio.Event(), asyncio.Event()]
    readers = [
        asyncio.create_task(read_stream(client, transformers.model, f"rollout {i}", event))
        for i, event in enumerate(started)
    ]
    for event in started:
        await asyncio.wait_for(event.wait(), CLIENT_TIMEOUT_S)
    async with httpx.AsyncClient(
        base_url=transformers.server.base_url, timeout=CLIENT_TIMEOUT_S
    ) as admin:
        answer = await admin.post(path, json=body)
    assert answer.status_code == 200, answer.text
    aborted = answer.json()["aborted"]
    assert (len(aborted) if isinstance(aborted, list) else aborted) == 2
    for read in await asyncio.gather(*readers):
        assert read.finish_reason == "abort"
        assert read.content, "the aborted stream keeps what it produced"
    after = await client.completions.create(
        model=transformers.model, prompt="next rollout", max_tokens=3
    )
    assert after.choices[0].finish_reason in ("length", "stop")


def test_reset_tensors_then_a_push_back_passes_the_weights_check_on_transformers(
    transformers: Served,
) -> None:
    """SGLang's check that a push rewrote every tensor: snapshot, reset, push, compare."""
    with httpx.Client(base_url=transformers.server.base_url, timeout=CLIENT_TIMEOUT_S) as client:

        def check(action: str) -> httpx.Response:
            return client.post("/weights_checker", json={"action": action})

        assert check("snapshot").status_code == 200
        assert check("reset_tensors").status_code == 200
        differs = check("compare")
        assert differs.status_code == 400, differs.text
        assert "lm_head.weight" in differs.json()["error"]["mismatches"]
        assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        pushed = client.post("/update_weights_from_disk", json={"model_path": transformers.model})
        assert pushed.status_code == 200, pushed.text
        assert client.post("/continue_generation").status_code == 200
        restored = check("compare")
        assert restored.status_code == 200 and restored.json()["match"] is True, restored.text
