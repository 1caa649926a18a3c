"""The data plane without Ray: a replica's stream server and the ingress's streams over
one loopback connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from penstock.errors import InvalidRequestError, ReplicaLostError
from penstock.ray.batching import StreamServer
from penstock.ray.routing import set_rotation
from penstock.ray.streams import FleetStreams
from penstock.ray.wire import ADDRESS_KEY, HELLO, MAX_FRAME_BYTES, WINDOW, entry_error

TOKEN = "fleet-token"


class Source:
    """A replica's chunks: ``count`` of them per request, recording how each one ended."""

    def __init__(self, count: int, *, fail_after: int | None = None) -> None:
        self.count = count
        self.fail_after = fail_after
        self.produced: dict[str, int] = {}
        self.closed: list[str] = []
        self.adapters: list[Any] = []

    async def __call__(
        self, request_id: str, request: dict[str, Any], adapter: tuple[str, str] | None
    ) -> AsyncIterator[dict[str, Any]]:
        self.adapters.append(adapter)
        try:
            for index in range(self.count):
                if index == self.fail_after:
                    raise InvalidRequestError("bad stop", param="stop")
                self.produced[request_id] = index + 1
                yield {"token_ids": [index], "text": request["prompt"], "raw": b"\x00\x01"}
                await asyncio.sleep(0)
        finally:
            self.closed.append(request_id)


async def fleet_of(source: Source, token: str = TOKEN) -> tuple[StreamServer, FleetStreams]:
    server = StreamServer(source, TOKEN, "replica r0")
    address = await server.start("127.0.0.1")
    streams = FleetStreams(token, "data-plane-test", 8, lambda name: 0)
    streams.update({"r0": {ADDRESS_KEY: address}})
    return server, streams


async def collect(streams: FleetStreams, request_id: str) -> list[dict[str, Any]]:
    _, stream = await streams.open(request_id, {"prompt": request_id}, ("lora", "/a"), None)
    return [chunk async for batch in stream.batches() for chunk in batch]


def test_many_streams_share_one_connection_and_arrive_whole() -> None:
    async def scenario() -> None:
        source = Source(300)
        server, streams = await fleet_of(source)
        results = await asyncio.gather(*(collect(streams, f"req-{i}") for i in range(5)))
        for i, chunks in enumerate(results):
            assert [c["token_ids"][0] for c in chunks] == list(range(300))
            assert {c["text"] for c in chunks} == {f"req-{i}"}
            assert chunks[0]["raw"] == b"\x00\x01"
        assert len(server.connections) == 1
        assert source.adapters == [("lora", "/a")] * 5
        streams.close()
        await server.close()

    asyncio.run(scenario())


def test_an_error_ends_the_stream_with_its_status_and_param() -> None:
    async def scenario() -> None:
        server, streams = await fleet_of(Source(10, fail_after=3))
        *chunks, last = await collect(streams, "failing")
        assert len(chunks) == 3
        error = entry_error(last)
        assert isinstance(error, InvalidRequestError)
        assert (error.status_code, error.param) == (400, "stop")
        await server.close()

    asyncio.run(scenario())


def test_a_stream_the_ingress_stops_reading_holds_a_window_of_batches_here() -> None:
    async def scenario() -> None:
        source = Source(10_000)
        server, streams = await fleet_of(source)
        _, stream = await streams.open("slow", {"prompt": "x"}, None, None)
        batches = stream.batches()
        received = list(await anext(batches))
        for _ in range(50):
            await asyncio.sleep(0.01)
        # The replica queues the rest (its engine runs on); the ingress holds a window.
        assert 0 < len(stream.inbox) <= WINDOW
        received += [chunk async for batch in batches for chunk in batch]
        assert [c["token_ids"][0] for c in received] == list(range(10_000))
        await server.close()

    asyncio.run(scenario())


def test_cancelling_a_stream_closes_its_chunks_on_the_replica_once() -> None:
    async def scenario() -> None:
        source = Source(20_000)
        server, streams = await fleet_of(source)
        _, stream = await streams.open("leaving", {"prompt": "x"}, None, None)
        async for _ in stream.batches():
            stream.cancel()
        for _ in range(100):
            if source.closed:
                break
            await asyncio.sleep(0.01)
        assert source.closed == ["leaving"]
        assert source.produced["leaving"] < 20_000
        other = await collect(streams, "after")
        assert len(other) == 20_000
        await server.close()

    asyncio.run(scenario())


def test_a_lost_connection_fails_the_stream_as_replica_lost() -> None:
    async def scenario() -> None:
        source = Source(20_000)
        server, streams = await fleet_of(source)
        _, stream = await streams.open("orphan", {"prompt": "x"}, None, None)
        with pytest.raises(ReplicaLostError):
            async for _ in stream.batches():
                await server.close()
        for _ in range(100):
            if source.closed:
                break
            await asyncio.sleep(0.01)
        assert source.closed == ["orphan"]

    asyncio.run(scenario())


def test_a_connection_without_the_fleet_token_opens_no_stream() -> None:
    async def scenario() -> None:
        source = Source(5)
        server, streams = await fleet_of(source, token="not-the-token")
        with pytest.raises(ReplicaLostError):
            await collect(streams, "intruder")
        assert source.produced == {}
        await server.close()

    asyncio.run(scenario())


def test_a_request_waits_for_a_replica_in_rotation_then_streams_there() -> None:
    async def scenario() -> None:
        first, second = Source(3), Source(3)
        servers = [StreamServer(s, TOKEN, f"replica {i}") for i, s in enumerate((first, second))]
        addresses = [await server.start("127.0.0.1") for server in servers]
        streams = FleetStreams(TOKEN, "rotation-test", 8, lambda name: 0)
        view = {"r0": {ADDRESS_KEY: addresses[0]}, "r1": {ADDRESS_KEY: addresses[1]}}
        set_rotation("rotation-test", frozenset())
        try:
            streams.update(view)
            waiting = asyncio.ensure_future(collect(streams, "held"))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            set_rotation("rotation-test", frozenset({"r1"}))
            streams.update(view)
            assert len(await waiting) == 3
            assert (first.produced, second.produced) == ({}, {"held": 3})
        finally:
            set_rotation("rotation-test", None)
            for server in servers:
                await server.close()

    asyncio.run(scenario())


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_a_chunk_that_cannot_be_sent_fails_its_own_stream_only() -> None:
    async def broken(
        request_id: str, request: dict[str, Any], adapter: tuple[str, str] | None
    ) -> AsyncIterator[dict[str, Any]]:
        yield {"token_ids": [1], "int_keys": {7: 0.5}}
        yield {"token_ids": [2], "extra": Unpicklable() if request_id == "bad" else None}

    async def scenario() -> None:
        server = StreamServer(broken, TOKEN, "replica r0")
        streams = FleetStreams(TOKEN, "broken-test", 8, lambda name: 0)
        streams.update({"r0": {ADDRESS_KEY: await server.start("127.0.0.1")}})
        good, bad = await asyncio.gather(collect(streams, "good"), collect(streams, "bad"))
        assert [c["token_ids"] for c in good] == [[1], [2]] and good[0]["int_keys"] == {7: 0.5}
        error = entry_error(bad[-1])
        assert error is not None and error.status_code == 500
        await server.close()

    asyncio.run(scenario())


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server ends the connection: EOF (or a reset) before a generous wait
    runs out; the wait only keeps a server that never closes from hanging the test."""
    try:
        while await asyncio.wait_for(reader.read(65536), 10):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def frame(*fields: Any) -> bytes:
    body = msgspec.msgpack.encode(list(fields))
    return len(body).to_bytes(4, "big") + body


async def declare_and_send(writer: asyncio.StreamWriter, size: int, sent: int) -> None:
    """Declare a frame of ``size`` bytes, then send ``sent`` bytes of its body, as far as
    the server keeps the connection open."""
    writer.write(size.to_bytes(4, "big"))
    chunk = b"\x00" * (1 << 20)
    try:
        for _ in range(sent // len(chunk)):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass


def test_a_peer_without_the_token_declaring_a_huge_frame_is_closed_on_unread() -> None:
    async def scenario() -> None:
        source = Source(5)
        server = StreamServer(source, TOKEN, "replica r0")
        host, port = (await server.start("127.0.0.1")).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        sending = asyncio.ensure_future(declare_and_send(writer, 0x7FFFFFFF, 64 << 20))
        assert await closed_by_server(reader)
        await sending
        assert not server.connections and source.produced == {}
        writer.close()
        await server.close()

    asyncio.run(scenario())


def test_a_peer_of_the_fleet_declaring_a_frame_over_the_limit_is_closed_on() -> None:
    async def scenario() -> None:
        server = StreamServer(Source(5), TOKEN, "replica r0")
        host, port = (await server.start("127.0.0.1")).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frame(HELLO, TOKEN))
        sending = asyncio.ensure_future(declare_and_send(writer, MAX_FRAME_BYTES + 1, 8 << 20))
        assert await closed_by_server(reader)
        await sending
        assert not server.connections
        writer.close()
        await server.close()

    asyncio.run(scenario())


def test_a_peer_that_never_shows_the_token_is_closed_on() -> None:
    async def scenario() -> None:
        server = StreamServer(Source(5), TOKEN, "replica r0", hello_timeout_s=0.2)
        host, port = (await server.start("127.0.0.1")).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await closed_by_server(reader)
        assert not server.connections
        writer.close()
        # A peer of the fleet that greets at once keeps its connection past the timeout.
        streams = FleetStreams(TOKEN, "hello-test", 8, lambda name: 0)
        streams.update({"r0": {ADDRESS_KEY: f"{host}:{port}"}})
        assert len(await collect(streams, "greeted")) == 5
        await asyncio.sleep(0.4)
        assert len(await collect(streams, "later")) == 5
        assert len(server.connections) == 1
        await server.close()

    asyncio.run(scenario())
