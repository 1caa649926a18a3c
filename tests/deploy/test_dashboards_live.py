"""Every panel of every shipped dashboard shows data from a real Prometheus.

Debian's ``prometheus`` scrapes two real ``penstock serve`` processes every second (the
``sample`` LLM engine with small admission limits, and the tiny ``diffusion`` engine)
while a short workload runs: streamed and unary chat, completions, an admission burst
that sheds, an unknown model, an RL step (pause in abort mode under load, update the
weights from disk, set a version, resume) and a video job. Then each panel query is
evaluated over the run through Prometheus's HTTP API, the way Grafana asks for it; a
query with no series or only NaN points is a panel that would show nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from penstock.engines.samples.engine import write_sample_weights
from tests.deploy.support import PanelQuery, panel_queries, tool
from tests.support.server import ServerProcess, free_port, start_server

LLM = "sample-model"
VIDEO = {"model": "tiny-wan", "prompt": "a cat", "num_inference_steps": 2, "seed": 5}
SCRAPE_S = 1
READY_S = 60.0
# Small admission limits: the burst below overflows them, so some requests are shed.
LLM_ARGS = ["--engine", "sample", "--max-concurrency", "3", "--max-queue", "1"]
LLM_ARGS += ["--", "--delay", "0.02"]
MEDIA_ARGS = ["--engine", "diffusion"]


@dataclass
class Stack:
    llm: ServerProcess
    media: ServerProcess
    prometheus: str
    start: float
    end: float = 0.0


def wait_until(check: object, what: str, timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.1)
    raise AssertionError(f"{what} not ready in {timeout}s")


@contextlib.contextmanager
def prometheus(targets: list[str], folder: Path) -> Iterator[str]:
    port = free_port()
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "penstock", "static_configs": [{"targets": targets}]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    with (folder / "prometheus.log").open("w") as log:
        process = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def all_targets_up(url: str, count: int) -> bool:
    targets = httpx.get(f"{url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
    return len(targets) == count and all(target["health"] == "up" for target in targets)


def chat(max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": LLM,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def request(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> int:
    async with client.stream("POST", path, json=body) as response:
        async for _ in response.aiter_bytes():
            pass
        return response.status_code


async def finished(client: httpx.AsyncClient, job: str) -> None:
    deadline = time.monotonic() + 30
    while (await client.get(f"/v1/videos/{job}")).json()["status"] != "completed":
        assert time.monotonic() < deadline, f"video job {job} did not complete"
        await asyncio.sleep(0.2)


async def workload(llm: str, media: str, weights: Path) -> None:
    async with (
        httpx.AsyncClient(base_url=llm, timeout=30) as client,
        httpx.AsyncClient(base_url=media, timeout=30) as media_client,
    ):
        video = await media_client.post("/v1/videos", json=VIDEO)
        assert video.status_code == 200, video.text
        burst = [
            request(client, "/v1/chat/completions", chat(15, stream=n % 3 != 0)) for n in range(10)
        ]
        burst.append(request(client, "/v1/completions", {"model": LLM, "prompt": "x"}))
        statuses = await asyncio.gather(*burst)
        assert 200 in statuses and 529 in statuses, statuses
        missing = await client.post("/v1/chat/completions", json={**chat(1, False), "model": "x"})
        assert missing.status_code == 404

        # One RL step with rollouts in flight: the abort-mode pause ends them.
        rollouts = [
            asyncio.create_task(request(client, "/v1/chat/completions", chat(200, stream=True)))
            for _ in range(2)
        ]
        await asyncio.sleep(0.3)
        write_sample_weights(weights, 7)
        for path, body in (
            ("/engine/pause_generation", {"mode": "abort"}),
            ("/engine/update_weights_from_disk", {"model_path": str(weights)}),
            ("/engine/set_weight_version", {"weight_version": "step-1"}),
            ("/engine/resume_generation", {}),
        ):
            answer = await client.post(path, json=body)
            assert answer.is_success, f"{path}: {answer.text}"
        await asyncio.gather(*rollouts)
        await asyncio.gather(
            *(request(client, "/v1/chat/completions", chat(20, stream=True)) for _ in range(3))
        )

        await finished(media_client, video.json()["id"])
        # A second job once the first one's series were scraped: windowed panels see a
        # change only in series that existed at the scrape before.
        await asyncio.sleep(1.5 * SCRAPE_S)
        video = await media_client.post("/v1/videos", json=VIDEO)
        assert video.status_code == 200, video.text
        await finished(media_client, video.json()["id"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tool("prometheus")
    folder = tmp_path_factory.mktemp("dashboards-live")
    cache = ["--cache-dir", str(folder / "cache")]
    llm = start_server([*cache, *LLM_ARGS], folder, wait_ready=False)
    media = start_server([*cache, *MEDIA_ARGS], folder, wait_ready=False)
    try:
        targets = [f"127.0.0.1:{server.port}" for server in (llm, media)]
        with prometheus(targets, folder) as url:
            for server in (llm, media):
                wait_until(
                    lambda server=server: httpx.get(f"{server.base_url}/health").is_success,
                    f"penstock serve on {server.port}:\n{server.log()}",
                )
            wait_until(lambda: all_targets_up(url, 2), "Prometheus' scrape of both gateways")
            run = Stack(llm, media, url, start=time.time())
            asyncio.run(workload(llm.base_url, media.base_url, folder / "weights.safetensors"))
            # The last state must be scraped, then the rate windows can close over it.
            time.sleep(3 * SCRAPE_S)
            run.end = time.time()
            yield run
    finally:
        for server in (llm, media):
            if server.process.poll() is None:
                server.stop(signal.SIGKILL)


def has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(value)) for series in result for _, value in series["values"])


# The fleet view needs a --ray gateway; tests/ray/test_fleet_routing.py checks that a real
# fleet's /metrics has every family its panels read.
@pytest.mark.parametrize("query", [q for q in panel_queries() if q.dashboard != "fleet"], ids=str)
def test_panel_shows_data(query: PanelQuery, stack: Stack) -> None:
    answer = httpx.get(
        f"{stack.prometheus}/api/v1/query_range",
        params={
            "query": query.evaluable(),
            "start": stack.start,
            "end": stack.end,
            "step": f"{SCRAPE_S}s",
        },
        timeout=10,
    ).json()
    assert answer["status"] == "success", answer
    assert has_data(answer["data"]["result"]), f"{query} shows nothing: {query.evaluable()}"
