"""What crosses from a replica to the ingress, without Ray: an error keeps its class,
status, param and code; chunks leave in batches and an error ends the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from penstock.errors import ConflictError, InvalidRequestError, PenstockError
from penstock.ray.batching import ChunkBatcher
from penstock.ray.wire import (
    answer_error,
    decode_error,
    encode_error,
    entry_error,
    error_entry,
    failed_answer,
    ok_answer,
)


def test_an_error_crosses_with_its_class_status_param_and_code() -> None:
    sent = InvalidRequestError("bad lora_path", param="lora_path", code="engine_rejected")
    received = entry_error(error_entry(sent))
    assert isinstance(received, InvalidRequestError)
    assert (received.status_code, received.message, received.param, received.code) == (
        400,
        "bad lora_path",
        "lora_path",
        "engine_rejected",
    )


def test_an_error_class_the_ingress_does_not_know_arrives_as_its_status() -> None:
    encoded = {**encode_error(PenstockError("odd")), "class": "NotAPenstockError", "status": 418}
    received = decode_error(encoded)
    assert type(received) is PenstockError
    assert (received.status_code, received.message) == (418, "odd")


def test_a_chunk_is_no_error_entry() -> None:
    assert entry_error({"token_ids": [1], "error": None}) is None
    assert entry_error({"replica": "r1"}) is None


def test_admin_answers_name_the_replica() -> None:
    assert ok_answer("r1", rank=2) == {"replica": "r1", "ok": True, "rank": 2}
    failed = failed_answer("r2", ConflictError("busy", code="replica_not_in_update"))
    assert (failed["replica"], failed["ok"]) == ("r2", False)
    error = answer_error(failed)
    assert isinstance(error, ConflictError)
    assert (error.status_code, error.code) == (409, "replica_not_in_update")


async def drain(chunks: AsyncIterator[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each batch taken when the batcher calls back, until its chunks end."""
    ready = asyncio.Event()
    batcher = ChunkBatcher(chunks, "request r", ready.set)
    batches = []
    while not batcher.ended:
        await ready.wait()
        ready.clear()
        if batch := batcher.take():
            batches.append(batch)
    return batches


async def test_chunks_produced_between_takes_leave_as_one_batch() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        for index in range(3):
            yield {"token_ids": [index]}

    assert await drain(chunks()) == [[{"token_ids": [0]}, {"token_ids": [1]}, {"token_ids": [2]}]]


async def test_the_batcher_calls_back_at_a_batch_s_first_chunk_and_at_the_end() -> None:
    calls = []
    more = asyncio.Event()

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        for index in range(3):
            yield {"token_ids": [index]}
        await more.wait()
        yield {"token_ids": [3]}

    ended = asyncio.Event()

    def ready() -> None:
        calls.append(batcher.ended)
        if batcher.ended:
            ended.set()

    batcher = ChunkBatcher(chunks(), "request r", ready)
    await asyncio.sleep(0)
    assert calls == [False]
    assert len(batcher.take()) == 3
    more.set()
    await asyncio.wait_for(ended.wait(), 5)
    assert calls == [False, False, True]
    assert batcher.take() == [{"token_ids": [3]}]


async def test_an_engine_error_is_the_last_entry_of_the_stream() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"token_ids": [7]}
        raise InvalidRequestError("too long", param="max_tokens")

    batches = await drain(chunks())
    entries = [entry for batch in batches for entry in batch]
    assert entries[0] == {"token_ids": [7]}
    error = entry_error(entries[-1])
    assert isinstance(error, InvalidRequestError) and error.param == "max_tokens"
    assert len(entries) == 2


async def test_an_unexpected_failure_is_an_internal_error_entry() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        raise RuntimeError("engine bug")
        yield {}

    [[entry]] = await drain(chunks())
    error = entry_error(entry)
    assert error is not None and error.status_code == 500
    assert "engine bug" not in error.message


async def test_cancelling_the_batcher_cancels_the_running_request() -> None:
    cancelled = asyncio.Event()

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"token_ids": [1]}
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    ready = asyncio.Event()
    batcher = ChunkBatcher(chunks(), "request r", ready.set)
    await ready.wait()
    assert batcher.take() == [{"token_ids": [1]}]
    batcher.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)
    assert not batcher.ended
