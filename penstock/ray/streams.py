"""The ingress's end of the data plane: one connection per replica, the streams over it,
and the replica each request goes to.

:class:`FleetStreams` picks the replica by :mod:`penstock.ray.routing`'s rule (least
loaded by the ingress's own count of running streams, bounded session and prefix
affinity, only replicas in rotation) from the replicas of the last fleet view, each with
the address of its :class:`~penstock.ray.batching.StreamServer`. The first request to a
replica opens the connection (:class:`ReplicaChannel`), which every later stream to it
shares. A connection that closes fails each of its streams with
:class:`~penstock.errors.ReplicaLostError`; the next request to that replica, if it is
still in the view, connects again. With no replica to take a request, it waits for the
next view.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from penstock.errors import ReplicaLostError
from penstock.ray import wire
from penstock.ray.inbox import Inbox
from penstock.ray.routing import SAMPLE, choose, in_rotation, preference

logger = logging.getLogger(__name__)

_LOST = object()


class IngressStream:
    """One request's batches from its replica."""

    def __init__(self, channel: ReplicaChannel, stream_id: int) -> None:
        self._channel = channel
        self._id = stream_id
        self.inbox: Inbox[Any] = Inbox()

    async def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The replica's chunks, as many as have arrived at a time, until it ends the
        stream; raises :class:`~penstock.errors.ReplicaLostError` when the connection
        closed first."""
        consumed = 0
        while True:
            arrived = await self.inbox.take()
            # The end, a loss or a cancel comes last: nothing is put after it.
            last = arrived[-1] if arrived[-1] is None or arrived[-1] is _LOST else False
            if last is not False:
                arrived.pop()
            if len(arrived) == 1:
                yield arrived[0]
            elif arrived:
                yield [chunk for batch in arrived for chunk in batch]
            if last is _LOST:
                raise ReplicaLostError(
                    "the engine replica serving this request failed; retry the request"
                )
            if last is None:
                return
            consumed += len(arrived)
            if consumed >= wire.WINDOW // 2:
                self._channel.credit(self._id, consumed)
                consumed = 0

    def cancel(self) -> None:
        """Stop the stream on the replica (its host aborts the request once) and end it here."""
        if self._channel.detach(self._id):
            self._channel.send(wire.CANCEL, self._id)
            self.inbox.put(None)


class ReplicaChannel:
    """The ingress's one connection to a replica."""

    def __init__(self, name: str, address: str, token: str) -> None:
        self.name = name
        self.address = address
        self.lost = False
        self._token = token
        self._protocol: wire.FrameProtocol | None = None
        self._connected: asyncio.Task[None] | None = None
        self._streams: dict[int, IngressStream] = {}
        self._ids = itertools.count()
        # Credit returned this turn of the loop, sent in one frame: stream id, credit, ...
        self._credits: list[int] = []

    async def connect(self) -> None:
        if self._connected is None:
            self._connected = asyncio.get_running_loop().create_task(self._connect())
        try:
            await asyncio.shield(self._connected)
        except OSError as exc:
            self.lost = True
            raise ReplicaLostError(
                f"the engine replica {self.name} cannot be reached at {self.address}: {exc}"
            ) from exc

    async def _connect(self) -> None:
        host, port = self.address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        _, self._protocol = await loop.create_connection(
            lambda: wire.FrameProtocol(self._on_frame, self._on_lost, trusted=True), host, int(port)
        )
        self._protocol.send(wire.HELLO, self._token)

    def open(
        self, request_id: str, request: dict[str, Any], adapter: tuple[str, str] | None
    ) -> IngressStream:
        stream_id = next(self._ids)
        stream = self._streams[stream_id] = IngressStream(self, stream_id)
        if self.lost:
            stream.inbox.put(_LOST)
        else:
            try:
                self.send(wire.OPEN, stream_id, request_id, request, adapter)
            except Exception:
                del self._streams[stream_id]
                raise
        return stream

    def send(self, *frame: Any) -> None:
        if self._protocol is not None:
            self._protocol.send(*frame)

    def credit(self, stream_id: int, batches: int) -> None:
        if not self._credits:
            asyncio.get_running_loop().call_soon(self._send_credits)
        self._credits += (stream_id, batches)

    def _send_credits(self) -> None:
        credits, self._credits = self._credits, []
        self.send(wire.CREDIT, credits)

    def detach(self, stream_id: int) -> bool:
        return self._streams.pop(stream_id, None) is not None

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.close()

    def _on_frame(self, frame: list[Any]) -> None:
        if frame[0] != wire.BATCH:
            return
        # A stream cancelled here is skipped: the replica's last frames were under way.
        streams = self._streams
        batches = frame[1]
        for i in range(0, len(batches), 2):
            if (stream := streams.get(batches[i])) is not None:
                stream.inbox.put(batches[i + 1])
        for stream_id in frame[2]:
            if (stream := streams.pop(stream_id, None)) is not None:
                stream.inbox.put(None)

    def _on_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._streams:
            logger.warning("the connection to engine replica %s closed: %s", self.name, exc)
        for stream in self._streams.values():
            stream.inbox.put(_LOST)
        self._streams.clear()


class FleetStreams:
    """Routes each request to a replica and opens its stream there."""

    def __init__(
        self,
        token: str,
        app_name: str,
        max_imbalance: int,
        running: Callable[[str], int],
    ) -> None:
        self._token = token
        self._app_name = app_name
        self._max_imbalance = max_imbalance
        self._running = running
        self._addresses: dict[str, str] = {}
        self._channels: dict[str, ReplicaChannel] = {}
        self._view_changed = asyncio.Event()

    def update(self, view: Mapping[str, Mapping[str, Any]]) -> None:
        """Take the replicas of a fresh fleet view (name: status with its address)."""
        self._addresses = {
            name: str(entry[wire.ADDRESS_KEY])
            for name, entry in view.items()
            if entry.get(wire.ADDRESS_KEY)
        }
        for name, channel in list(self._channels.items()):
            if channel.lost or self._addresses.get(name) != channel.address:
                del self._channels[name]
        changed, self._view_changed = self._view_changed, asyncio.Event()
        changed.set()

    async def open(
        self,
        request_id: str,
        request: dict[str, Any],
        adapter: tuple[str, str] | None,
        key: str | None,
    ) -> tuple[str, IngressStream]:
        """The chosen replica's name and the request's stream on it, waiting for a replica
        when none can take it."""
        while (name := self._choose(key)) is None:
            await self._view_changed.wait()
        channel = self._channels.get(name)
        if channel is None or channel.lost:
            channel = self._channels[name] = ReplicaChannel(
                name, self._addresses[name], self._token
            )
        await channel.connect()
        return name, channel.open(request_id, request, adapter)

    def _choose(self, key: str | None) -> str | None:
        candidates = in_rotation(self._app_name, list(self._addresses), str)
        candidates = [name for name in candidates if not self._lost(name)]
        if not candidates:
            return None
        sampled = random.sample(candidates, min(len(candidates), SAMPLE))
        preferred = None
        if key and len(candidates) > 1:
            preferred = preference(key, candidates)[0]
            sampled = [preferred, *(name for name in sampled if name != preferred)][:SAMPLE]
        loads = [(name, self._running(name)) for name in sampled]
        return choose(preferred, loads, max_imbalance=self._max_imbalance)

    def _lost(self, name: str) -> bool:
        channel = self._channels.get(name)
        return channel is not None and channel.lost

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
