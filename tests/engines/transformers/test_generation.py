"""What a caller of ``generate`` sees: sampling, stop rules, batching, cancellation."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from penstock.engines.context import Context
from penstock.engines.host import EngineHost
from penstock.engines.transformers import TransformersEngine
from penstock.errors import InvalidRequestError
from tests.engines.transformers.conftest import copy_with_eos, start_engine
from tests.engines.transformers.helpers import PROMPT, greedy, run, tokens


def sampled(seed: int | None, n: int = 1, **options: float) -> dict:
    return {
        "token_ids": PROMPT,
        "sampling_options": {"temperature": 1.0, "seed": seed, "n": n, **options},
        "stop_conditions": {"max_tokens": 24, "ignore_eos": True},
    }


async def test_same_seed_gives_same_tokens(engine: TransformersEngine) -> None:
    first = await tokens(engine, sampled(1234, top_p=0.95, top_k=200, min_p=0.001))
    again = await tokens(engine, sampled(1234, top_p=0.95, top_k=200, min_p=0.001))
    other = await tokens(engine, sampled(99, top_p=0.95, top_k=200, min_p=0.001))
    assert first == again
    assert first != other


async def test_greedy_output_is_the_same_alone_and_in_a_batch(
    engine: TransformersEngine,
) -> None:
    requests = [greedy(list(range(20 + i, 30 + 3 * i)), max_tokens=12 + 2 * i) for i in range(8)]
    alone = [await tokens(engine, request) for request in requests]
    together = await asyncio.gather(*(tokens(engine, request) for request in requests))
    assert together == alone


async def test_max_tokens_ends_with_length_and_counts_usage(engine: TransformersEngine) -> None:
    choice = (await run(engine, greedy(max_tokens=9)))[0]
    assert choice.finish_reason == "length"
    assert len(choice.token_ids) == 9
    assert choice.usage == {
        "prompt_tokens": 7,
        "completion_tokens": 9,
        "total_tokens": 16,
        # Seven tokens fill no block of 16: nothing to take from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(len(chunk["token_ids"]) == 1 for chunk in choice.chunks)


async def test_stop_token_id_ends_with_stop_and_includes_the_token(
    engine: TransformersEngine,
) -> None:
    reference = await tokens(engine, greedy(max_tokens=30))
    position = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 2)
    choice = (await run(engine, greedy(max_tokens=30, stop_token_ids=[reference[position]])))[0]
    assert choice.finish_reason == "stop"
    assert choice.token_ids == reference[: position + 1]


async def test_min_tokens_holds_back_stop_tokens(engine: TransformersEngine) -> None:
    reference = await tokens(engine, greedy(max_tokens=8))
    choice = (await run(engine, greedy(max_tokens=8, stop_token_ids=[reference[0]], min_tokens=4)))[
        0
    ]
    assert len(choice.token_ids) >= 4
    assert reference[0] not in choice.token_ids[:4]


async def test_eos_stops_unless_ignore_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    probe = await start_engine(tiny_model_dir)
    try:
        reference = await tokens(probe, greedy(max_tokens=12))
    finally:
        await probe.cleanup()
    eos = reference[3]
    engine = await start_engine(copy_with_eos(tiny_model_dir, tmp_path / "eos", eos))
    try:
        stopped = (await run(engine, greedy(max_tokens=12, ignore_eos=False)))[0]
        ignored = (await run(engine, greedy(max_tokens=12, ignore_eos=True)))[0]
    finally:
        await engine.cleanup()
    first_eos = reference.index(eos)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == reference[: first_eos + 1]
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == reference


async def test_n_choices_each_end_once(engine: TransformersEngine) -> None:
    choices = await run(engine, sampled(7, n=2))
    assert sorted(choices) == [0, 1]
    for choice in choices.values():
        assert choice.finish_reason == "length"
        assert len(choice.token_ids) == 24
        assert [c for c in choice.chunks if "finish_reason" in c] == [choice.chunks[-1]]
    assert choices[0].token_ids != choices[1].token_ids


async def test_logprobs_align_with_tokens(engine: TransformersEngine) -> None:
    request = greedy(max_tokens=5)
    request["output_options"] = {"logprobs": 3}
    choice = (await run(engine, request))[0]
    for chunk in choice.chunks:
        assert len(chunk["log_probs"]) == len(chunk["token_ids"]) == 1
        (top,) = chunk["top_logprobs"]
        assert [entry["rank"] for entry in top] == [1, 2, 3]
        values = [entry["logprob"] for entry in top]
        assert values == sorted(values, reverse=True)
        # Greedy picks the most likely token, so it is rank 1 with the same logprob.
        assert top[0]["token_id"] == chunk["token_ids"][0]
        assert top[0]["logprob"] == pytest.approx(chunk["log_probs"][0])
        assert chunk["log_probs"][0] <= 0.0

    request["output_options"] = {"logprobs": 0}
    only_sampled = (await run(engine, request))[0]
    assert all("log_probs" in c and "top_logprobs" not in c for c in only_sampled.chunks)


async def test_penalties_change_a_repetitive_greedy_output(engine: TransformersEngine) -> None:
    plain = await tokens(engine, greedy(max_tokens=24))
    assert len(set(plain)) < len(plain), "the tiny model repeats itself under greedy decoding"
    request = greedy(max_tokens=24)
    request["sampling_options"]["repetition_penalty"] = 5.0
    request["sampling_options"]["frequency_penalty"] = 2.0
    penalised = await tokens(engine, request)
    assert len(set(penalised)) > len(set(plain))


async def test_every_chunk_names_the_weight_version(engine: TransformersEngine) -> None:
    await engine.engine_update("set_weight_version", {"weight_version": "step-3"})
    choice = (await run(engine, greedy(max_tokens=3)))[0]
    assert [c["engine_data"] for c in choice.chunks] == [{"weight_version": "step-3"}] * 3


async def _first_chunk(stream) -> dict:
    async with asyncio.timeout(5.0):
        return await anext(stream)


async def test_cancel_mid_stream_ends_within_two_seconds_and_frees_kv(
    engine: TransformersEngine,
) -> None:
    context = Context("to-cancel")
    stream = engine.generate(greedy(max_tokens=400), context)
    await _first_chunk(stream)
    await _first_chunk(stream)  # a decoded token: the sequence holds KV in the batch
    assert engine.scheduler.usage().used_blocks > 0
    cancelled_at = time.monotonic()
    context.stop_generating()
    rest = [chunk async for chunk in stream]
    assert time.monotonic() - cancelled_at < 2.0
    assert rest[-1]["finish_reason"] == "cancelled"
    assert rest[-1]["completion_usage"]["completion_tokens"] < 400
    usage = engine.scheduler.usage()
    assert (usage.used_blocks, usage.running) == (0, 0)


async def test_abort_removes_the_request(engine: TransformersEngine) -> None:
    context = Context("to-abort")
    stream = engine.generate(greedy(max_tokens=400), context)
    await _first_chunk(stream)
    await engine.abort(context)
    rest = [chunk async for chunk in stream]
    assert rest[-1]["finish_reason"] == "cancelled"
    assert engine.scheduler.usage().running == 0


async def test_a_long_request_does_not_block_a_short_one(engine: TransformersEngine) -> None:
    finished: list[str] = []

    async def consume(name: str, stream) -> None:
        async for chunk in stream:
            if "finish_reason" in chunk:
                finished.append(name)

    long_stream = engine.generate(greedy(max_tokens=300), Context("long"))
    await _first_chunk(long_stream)
    long_task = asyncio.create_task(consume("long", long_stream))
    await consume("short", engine.generate(greedy([40, 41, 42], max_tokens=5), Context("short")))
    await long_task
    assert finished == ["short", "long"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sampling_options": {"guided_decoding": {"json": {}, "regex": "a"}}}, "guided_decoding"),
        ({"sampling_options": {"response_format": {"type": "json_object"}}}, "response_format"),
        ({"sampling_options": {"temperature": -1}}, "temperature"),
        ({"sampling_options": {"top_p": 2}}, "top_p"),
        ({"sampling_options": {"n": 99}}, "n"),
        ({"stop_conditions": {"max_tokens": 10_000}}, "max_tokens"),
        ({"stop_conditions": {"stop_token_ids": [-3]}}, "stop_token_ids"),
        ({"output_options": {"logprobs": 50}}, "logprobs"),
        ({"output_options": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"output_options": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"token_ids": [1, 2, 10**9]}, "token_ids"),
        ({"token_ids": list(range(600))}, "context length"),
    ],
)
async def test_bad_requests_are_rejected_naming_the_field(
    engine: TransformersEngine, change: dict, field: str
) -> None:
    request = greedy(max_tokens=4)
    for key, value in change.items():
        request[key] = {**request.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=field):
        await run(engine, request)
    assert await tokens(engine, greedy(max_tokens=2)), "the engine keeps serving"


async def test_host_turns_a_bad_request_into_a_400(engine: TransformersEngine) -> None:
    host = EngineHost(engine, None)
    host.state = host.state.RUNNING
    request = greedy(max_tokens=4)
    request["sampling_options"]["guided_decoding"] = {"regex": "(["}
    with pytest.raises(InvalidRequestError) as caught:
        async for _ in host.generate(request, Context()):
            pass
    assert caught.value.status_code == 400
    assert "guided_decoding" in caught.value.message


async def test_a_consumer_cancelled_through_the_host_frees_the_sequence_at_once(
    tiny_model_dir: Path,
) -> None:
    engine, worker_config = await TransformersEngine.from_args(["--model", str(tiny_model_dir)])
    host = EngineHost(engine, worker_config)
    await host.start()
    try:
        # Cancel-safe: the host drives the engine from the consumer's task.
        assert host.cancel_safe

        decoding = asyncio.Event()

        async def consume(stream) -> None:
            chunks = 0
            async for _ in stream:
                chunks += 1
                if chunks == 2:  # a decoded token: the sequence holds KV in the batch
                    decoding.set()

        task = asyncio.create_task(consume(host.generate(greedy(max_tokens=400), Context("gone"))))
        async with asyncio.timeout(5.0):
            await decoding.wait()
        assert engine.scheduler.usage().used_blocks > 0
        cancelled_at = engine.latest_forward_pass_metrics.counter_id
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The scheduler's thread lets the sequence go at its next step; nothing signals it.
        async with asyncio.timeout(5.0):
            while engine.scheduler.usage().running or engine.scheduler.usage().used_blocks:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        # Freed within a few forward passes, not after the ~400 of running to its end.
        assert engine.latest_forward_pass_metrics.counter_id - cancelled_at < 20
        after = [c async for c in host.generate(greedy(max_tokens=4), Context("after"))]
        assert after[-1]["finish_reason"] == "length"
    finally:
        await host.cleanup()
