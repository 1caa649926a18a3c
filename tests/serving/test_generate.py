"""SGLang's ``/generate`` and ``/health_generate`` on the sample engine (in-process ASGI)."""

from __future__ import annotations

import httpx
import orjson
import pytest


async def test_generate_takes_input_ids_and_answers_in_sglang_shape(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["output_ids"]) == 4 and isinstance(body["text"], str) and body["text"]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert "weight_version" in meta
    assert [entry[1] for entry in meta["output_token_logprobs"]] == body["output_ids"]


async def test_generate_streams_cumulative_events_then_done(client: httpx.AsyncClient) -> None:
    events = []
    async with client.stream(
        "POST",
        "/generate",
        json={"text": "hello there", "sampling_params": {"max_new_tokens": 3}, "stream": True},
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    objects = [orjson.loads(event) for event in events[:-1]]
    assert [len(o["output_ids"]) for o in objects] == [1, 2, 3]
    assert objects[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(o["meta_info"]["finish_reason"] is None for o in objects[:-1])
    assert objects[-1]["text"].startswith(objects[0]["text"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": "a", "sampling_params": {"temperature": 9}}, "sampling_params.temperature"),
        ({"input_ids": [], "sampling_params": {}}, "input_ids"),
        ({"text": "a", "model": "nope"}, "model"),
    ],
)
async def test_bad_generate_bodies_are_4xx_naming_the_field(
    client: httpx.AsyncClient, body: dict, param: str
) -> None:
    response = await client.post("/generate", json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"]


async def test_an_unknown_field_is_ignored_and_named_in_a_response_header(
    client: httpx.AsyncClient,
) -> None:
    params = {"max_new_tokens": 2, "max_new_token": 9}
    for stream in (False, True):
        body = {"text": "a", "sampling_params": params, "stream": stream, "colour": "red"}
        response = await client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        ignored = response.headers["x-penstock-ignored-fields"]
        assert ignored == "colour, sampling_params.max_new_token"
    plain = await client.post("/generate", json={"text": "a", "sampling_params": {}})
    assert "x-penstock-ignored-fields" not in plain.headers


async def test_health_generate_is_200_serving_and_503_paused(client: httpx.AsyncClient) -> None:
    healthy = await client.get("/health_generate")
    assert healthy.status_code == 200 and healthy.json()["status"] == "ok"
    await client.post("/pause_generation", json={"mode": "keep"})
    paused = await client.get("/health_generate")
    assert paused.status_code == 503 and "paused" in paused.json()["error"]["message"]
    await client.post("/continue_generation")
    assert (await client.get("/health_generate")).status_code == 200
