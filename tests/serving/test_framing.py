"""Stream bytes: encoded chunks, the error frame that ends a failed stream, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.types import Message

from penstock.errors import ClientClosedRequest, InvalidRequestError
from penstock.serving.chat import ChatFormat
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry
from penstock.serving.completions import CompletionFormat
from penstock.serving.framing import ChunkEncoder, unless_disconnected, with_error_frame
from penstock.serving.sse import DISCONNECT_KEY, DONE_FRAME, DisconnectSignal

HEAD = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "m",
    "system_fingerprint": "penstock-0-abcdef01",
}


def parse(frame: bytes) -> Any:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    return orjson.loads(frame[len(b"data: ") : -2])


def encoder() -> ChunkEncoder:
    return ChunkEncoder(
        HEAD["id"], HEAD["object"], HEAD["created"], HEAD["model"], HEAD["system_fingerprint"]
    )


def test_a_chunk_is_the_constant_head_then_choices_and_weight_version() -> None:
    choices = [{"index": 0, "text": 'say "hi"\n', "logprobs": None, "finish_reason": None}]
    assert parse(encoder().frame(choices, "v1")) == {
        **HEAD,
        "choices": choices,
        "weight_version": "v1",
    }


@given(
    texts=st.lists(st.text(min_size=1), min_size=1, max_size=4),
    index=st.integers(min_value=0, max_value=20),
    version=st.one_of(st.none(), st.text(max_size=8)),
)
def test_a_text_only_chat_delta_is_framed_as_its_whole_choice_would_be(
    texts: list[str], index: int, version: str | None
) -> None:
    chat = ChatFormat(None, return_token_ids=False)  # type: ignore[arg-type]
    choice = ChoiceState(
        index, None, None, prompt_token_ids=[], keep_text=False, want_logprobs=False
    )
    fast, whole = encoder(), encoder()
    for text in texts:
        delta = Delta(choice, text, [7], None, None, version, ())
        assert chat.text_only(delta)
        item = chat.chunk_choice(delta)
        assert item is not None
        framed = fast.text_frame(chat.text_choice, index, text, version)
        assert framed == whole.frame([item], version)


@given(
    deltas=st.lists(
        st.tuples(
            st.text(min_size=1),
            st.integers(min_value=0, max_value=2),
            st.sampled_from([None, "v1", "v2"]),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_interleaved_choices_and_weight_versions_are_each_framed_as_a_whole_choice(
    deltas: list[tuple[str, int, str | None]],
) -> None:
    """One stream's encoder: several choices, and a weight version changing midway."""
    chat = ChatFormat(None, return_token_ids=False)  # type: ignore[arg-type]
    fast, whole = encoder(), encoder()
    for text, index, version in deltas:
        choice = ChoiceState(
            index, None, None, prompt_token_ids=[], keep_text=False, want_logprobs=False
        )
        item = chat.chunk_choice(Delta(choice, text, [7], None, None, version, ()))
        assert item is not None
        framed = fast.text_frame(chat.text_choice, index, text, version)
        assert framed == whole.frame([item], version)


@given(
    texts=st.lists(st.text(min_size=1), min_size=1, max_size=4),
    index=st.integers(min_value=0, max_value=20),
)
def test_a_text_only_completion_delta_is_framed_as_its_whole_choice_would_be(
    texts: list[str], index: int
) -> None:
    completions = CompletionFormat(None, {}, return_token_ids=False)  # type: ignore[arg-type]
    choice = ChoiceState(
        index, None, None, prompt_token_ids=[], keep_text=False, want_logprobs=False
    )
    fast, whole = encoder(), encoder()
    for text in texts:
        delta = Delta(choice, text, [7], None, None, "v1", ())
        assert completions.text_only(delta)
        item = completions.chunk_choice(delta)
        assert item is not None
        framed = fast.text_frame(completions.text_choice, index, text, "v1")
        assert framed == whole.frame([item], "v1")


def test_an_echoed_completion_streams_the_prompt_ids_on_its_echo_chunk_only() -> None:
    completions = CompletionFormat(
        None,  # type: ignore[arg-type]
        {0: "echo"},
        return_token_ids=False,
        echoed_prompt_ids={0: [5, 6]},
    )
    choice = ChoiceState(0, None, None, prompt_token_ids=[], keep_text=False, want_logprobs=False)
    delta = Delta(choice, "a", [7], None, None, None, ())
    assert not completions.text_only(delta)
    assert completions.chunk_choice(delta) == {
        "index": 0,
        "text": "echoa",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": [5, 6],
    }
    assert not completions.text_only(delta)
    later = completions.chunk_choice(delta)
    assert later is not None and later["text"] == "a" and later["prompt_token_ids"] is None


def test_deltas_with_more_than_text_are_not_text_only() -> None:
    chat = ChatFormat(None, return_token_ids=False)  # type: ignore[arg-type]
    choice = ChoiceState(0, None, None, prompt_token_ids=[], keep_text=False, want_logprobs=False)
    assert not chat.text_only(Delta(choice, "", [7], None, None, None, ()))
    assert not chat.text_only(Delta(choice, "a", [7], None, "stop", None, ()))
    logprobs = [LogprobEntry(7, -0.5, [])]
    assert not chat.text_only(Delta(choice, "a", [7], logprobs, None, None, ()))
    with_ids = ChatFormat(None, return_token_ids=True)  # type: ignore[arg-type]
    assert not with_ids.text_only(Delta(choice, "a", [7], None, None, None, ()))


def test_each_chunk_carries_its_own_weight_version_and_usage_when_given() -> None:
    chunks = encoder()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    frames = [
        chunks.frame([], None),
        chunks.frame([], "v2"),
        chunks.frame([], None, usage),
        chunks.frame([], "v2"),
    ]
    parsed = [parse(frame) for frame in frames]
    assert [chunk["weight_version"] for chunk in parsed] == [None, "v2", None, "v2"]
    assert [chunk.get("usage") for chunk in parsed] == [None, None, usage, None]
    assert all({k: chunk[k] for k in HEAD} == HEAD for chunk in parsed)


async def collect(frames: AsyncIterator[bytes]) -> list[bytes]:
    return [frame async for frame in frames]


async def failing_after_one_frame(error: Exception) -> AsyncIterator[bytes]:
    yield b"data: {}\n\n"
    raise error


async def test_a_client_visible_error_ends_the_stream_with_its_envelope_then_done() -> None:
    error = InvalidRequestError("max_tokens is too large", param="max_tokens")
    frames = await collect(with_error_frame(failing_after_one_frame(error)))
    assert frames[0] == b"data: {}\n\n"
    assert parse(frames[1]) == error.envelope()
    assert frames[2:] == [DONE_FRAME]


async def test_an_unexpected_error_ends_the_stream_without_leaking_its_message() -> None:
    frames = await collect(
        with_error_frame(failing_after_one_frame(RuntimeError("/secret/path leaked")))
    )
    assert frames[2:] == [DONE_FRAME]
    error = parse(frames[1])["error"]
    assert error["type"] == "internal_server_error"
    assert "secret" not in frames[1].decode()


async def test_a_stream_that_ends_normally_passes_through_unchanged() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield DONE_FRAME

    assert await collect(with_error_frame(frames())) == [b"data: 1\n\n", DONE_FRAME]


def request_with(messages: list[Message]) -> Request:
    """A request whose client sends ``messages``, then stays connected."""
    forever = asyncio.Event()

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await forever.wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_work_that_finishes_returns_its_result() -> None:
    async def work() -> str:
        return "done"

    assert await unless_disconnected(request_with([]), work()) == "done"


async def test_work_that_fails_raises_its_own_error() -> None:
    async def work() -> str:
        raise InvalidRequestError("bad")

    with pytest.raises(InvalidRequestError):
        await unless_disconnected(request_with([]), work())


async def test_a_disconnect_cancels_the_work_and_answers_499() -> None:
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    request = request_with([{"type": "http.request", "body": b""}, {"type": "http.disconnect"}])
    with pytest.raises(ClientClosedRequest) as raised:
        await unless_disconnected(request, work())
    assert raised.value.status_code == 499
    assert cancelled.is_set()


async def test_the_servers_disconnect_signal_cancels_the_work_in_its_own_task() -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def work() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    signal = DisconnectSignal()
    request = request_with([])
    request.scope[DISCONNECT_KEY] = signal
    before = len(asyncio.all_tasks())
    waiter = asyncio.ensure_future(unless_disconnected(request, work()))
    await asyncio.wait_for(started.wait(), 5)
    assert len(asyncio.all_tasks()) == before + 1
    signal.fire()
    with pytest.raises(ClientClosedRequest):
        await asyncio.wait_for(waiter, 5)
    assert cancelled.is_set()
