"""Moving encoder embeddings from an encode process to the process that prefills with them
(``dynamo.common.multimodal.embedding_transfer``).

A sender turns a tensor into a :class:`TransferRequest` (shape, dtype and a mode-specific
``serialized_request``, JSON-safe, carried by whatever channel links the processes) and an
awaitable that completes once the sender's memory may be reused. The receiver turns the
request back into a tensor of the same shape, dtype and bytes, and is told with
``release_tensor`` when its memory may be reused.

- ``LOCAL``: a safetensors file on a shared filesystem; the receiver deletes it on release.
- ``NIXL_WRITE``: the receiver owns a registered ring buffer; it answers the request with a
  NIXL notification naming a slot (and its own agent metadata the first time), the sender
  WRITEs the tensor there and the notification tagged with the slot id tells the receiver
  the data is in. Metadata flows one way per peer, inside the messages themselves.
- ``NIXL_READ``: the sender registers the tensor and the request carries its address; the
  receiver READs it into a pre-registered slot (or a temporary buffer) and the READ's
  notification tells the sender its tensor is free.

NIXL runs over UCX (the agent and its import: :mod:`penstock.nixl_agent`). Nothing here
is thread-safe; each object belongs to one event loop.

This is engine-author API, kept with the names of ``dynamo.common.multimodal``
(``AbstractEmbeddingSender`` / ``Receiver``, ``Local*``, ``NixlWrite*``, ``NixlRead*``,
``TransferRequest``; ``EmbeddingTransferMode`` from ``dynamo.common.constants``): an
engine whose encoder runs in another process moves embeddings with it. The gateway's own
request path never sends any; its image and audio loaders only receive an item a NIXL
peer decoded (``NixlReadEmbeddingReceiver``). :func:`create_embedding_sender` and
:func:`create_embedding_receiver` pick the class of a mode.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import os
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

from penstock.nixl_agent import NixlAgent, mem_type_of

logger = logging.getLogger(__name__)

TENSOR_KEY = "ec_cache"
_ALIGN = 64
_POLL_S = 0.001


class EmbeddingTransferMode(StrEnum):
    LOCAL = "local"
    NIXL_WRITE = "nixl-write"
    NIXL_READ = "nixl-read"


class TransferRequest(BaseModel):
    embeddings_shape: list[int]
    # A torch dtype name without "torch."; unknown names read back as float32.
    embedding_dtype_str: str
    serialized_request: Any


class NixlTransferRequest(BaseModel):
    sender_agent_id: str
    agent_metadata: str | None = None
    tensor_id: int
    tensor_size: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else torch.float32


def _request_for(tensor: torch.Tensor, serialized: Any) -> TransferRequest:
    return TransferRequest(
        embeddings_shape=list(tensor.shape),
        embedding_dtype_str=dtype_name(tensor.dtype),
        serialized_request=serialized,
    )


def _as(raw: torch.Tensor, request: TransferRequest) -> torch.Tensor:
    """Bytes received into an int8 buffer, seen as the sent dtype and shape."""
    return raw.view(parse_dtype(request.embedding_dtype_str)).view(request.embeddings_shape)


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class AbstractEmbeddingSender(ABC):
    """Sends precomputed embeddings to the downstream worker."""

    @abstractmethod
    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, Awaitable[None]]:
        """The request to hand the receiver, and an awaitable done once the send is complete.

        ``stage_embeddings=True``: the sender uses ``embeddings`` in place, and the caller
        keeps it alive and unchanged until the awaitable is done. Otherwise the sender
        takes a copy and the awaitable may already be done.
        """


class AbstractEmbeddingReceiver(ABC):
    """Receives precomputed embeddings from the encode worker."""

    @abstractmethod
    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        """The tensor id and the received tensor; call ``release_tensor(tensor_id)`` once
        the tensor is no longer needed."""

    @abstractmethod
    def release_tensor(self, tensor_id: int) -> None:
        """The tensor with this id is no longer in use; unknown ids are ignored."""


class LocalEmbeddingSender(AbstractEmbeddingSender):
    """Saves embeddings to a local file and sends the file path as the serialized request."""

    def __init__(self) -> None:
        self._prefix = f"encoder_cache.{uuid.uuid4().hex[:12]}"
        self._counter = itertools.count()

    def save_embeddings_to_file(self, embedding_key: str, embeddings: torch.Tensor) -> str:
        """Save the embeddings to a local file and return the file path."""
        fd, path = tempfile.mkstemp(
            prefix=f"{self._prefix}_{next(self._counter)}.", suffix=".safetensors"
        )
        os.close(fd)
        save_file({embedding_key: embeddings.detach().to("cpu").contiguous()}, path)
        return path

    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, Awaitable[None]]:
        path = await asyncio.to_thread(self.save_embeddings_to_file, TENSOR_KEY, embeddings)
        return _request_for(embeddings, path), _done()


class LocalEmbeddingReceiver(AbstractEmbeddingReceiver):
    """Reads embeddings from the local file the serialized request names."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._paths: dict[int, str] = {}

    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        path = str(request.serialized_request)
        tensors = await asyncio.to_thread(load_file, path)
        tensor_id = next(self._counter)
        self._paths[tensor_id] = path
        return tensor_id, tensors[TENSOR_KEY]

    def release_tensor(self, tensor_id: int) -> None:
        path = self._paths.pop(tensor_id, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Registrations:
    """Memory registrations counted per region, so one tensor sent twice registers once."""

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self._held: dict[tuple[int, int, int], tuple[Any, int]] = {}

    def acquire(self, tensor: torch.Tensor) -> tuple[int, int, int]:
        key = (tensor.data_ptr(), tensor.nbytes, tensor.get_device())
        found = self._held.get(key)
        if found is None:
            self._held[key] = (self._agent.agent.register_memory(tensor), 1)
        else:
            self._held[key] = (found[0], found[1] + 1)
        return key

    def release(self, key: tuple[int, int, int]) -> None:
        registration, count = self._held.pop(key)
        if count > 1:
            self._held[key] = (registration, count - 1)
        else:
            self._agent.agent.deregister_memory(registration)


@dataclass
class _Outgoing:
    tensor: torch.Tensor
    key: tuple[int, int, int]
    done: asyncio.Future[None]
    since: float


class _NixlSender(AbstractEmbeddingSender):
    """What both NIXL senders share: an agent, registrations, and a task that polls NIXL
    notifications while sends are outstanding."""

    role = "sender"

    def __init__(self) -> None:
        self._agent: NixlAgent | None = None
        self._registrations: _Registrations | None = None
        self._pending: dict[int, _Outgoing] = {}
        self._ids = itertools.count()
        self._poller: asyncio.Task[None] | None = None

    def _ready(self) -> tuple[NixlAgent, _Registrations]:
        if self._agent is None or self._registrations is None:
            self._agent = NixlAgent(self.role)
            self._registrations = _Registrations(self._agent)
        return self._agent, self._registrations

    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, asyncio.Future[None]]:
        """Send precomputed embeddings."""
        agent, registrations = self._ready()
        tensor = (
            embeddings.contiguous()
            if stage_embeddings
            else embeddings.detach().clone(memory_format=torch.contiguous_format)
        )
        loop = asyncio.get_running_loop()
        tensor_id = next(self._ids)
        outgoing = _Outgoing(
            tensor, registrations.acquire(tensor), loop.create_future(), time.monotonic()
        )
        self._pending[tensor_id] = outgoing
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll())
        request = _request_for(embeddings, self._serialize(agent, tensor_id, tensor))
        return request, outgoing.done if stage_embeddings else _done()

    def _finish(self, tensor_id: int, ok: bool) -> None:
        outgoing = self._pending.pop(tensor_id, None)
        if outgoing is None:
            return
        assert self._registrations is not None
        self._registrations.release(outgoing.key)
        if not ok:
            logger.warning("embedding transfer %d failed on the NIXL side", tensor_id)
        if not outgoing.done.done():
            outgoing.done.set_result(None)

    async def _poll(self) -> None:
        agent = self._agent
        assert agent is not None
        while self._pending:
            for remote, message in agent.poll():
                await self._on_notification(agent, remote, message)
            now = time.monotonic()
            for tensor_id, outgoing in self._pending.items():
                if now - outgoing.since > 60:
                    logger.warning("embedding transfer %d still in flight after 60 s", tensor_id)
                    outgoing.since = now
            await asyncio.sleep(_POLL_S)

    @abstractmethod
    def _serialize(self, agent: NixlAgent, tensor_id: int, tensor: torch.Tensor) -> Any:
        """The mode-specific ``serialized_request``."""

    @abstractmethod
    async def _on_notification(self, agent: NixlAgent, remote: str, message: bytes) -> None:
        """Handle one notification from a receiver."""


class NixlWriteEmbeddingSender(_NixlSender):
    """NIXL WRITE-based implementation of the embedding sender interface.

    Memory is registered per send (the tensors are allocated elsewhere); the receiver's
    buffer is registered once, so letting the sender initiate the WRITE needs the least
    metadata exchange. Protocol: the request carries the sender's agent metadata and the
    tensor's id and size; the receiver answers with a notification naming its buffer slot
    (and its metadata, the first time); the sender WRITEs there, tagged with the slot id.
    """

    role = "write-sender"

    def _serialize(self, agent: NixlAgent, tensor_id: int, tensor: torch.Tensor) -> Any:
        return NixlTransferRequest(
            sender_agent_id=agent.name,
            agent_metadata=base64.b64encode(agent.metadata()).decode(),
            tensor_id=tensor_id,
            tensor_size=tensor.nbytes,
        ).model_dump_json()

    async def _on_notification(self, agent: NixlAgent, remote: str, message: bytes) -> None:
        try:
            tensor_id, (address, size, device_id, kind), slot_id, metadata = msgspec.msgpack.decode(
                message
            )
        except (ValueError, TypeError, msgspec.DecodeError):
            logger.warning("ignoring a malformed NIXL notification from %s", remote)
            return
        if metadata:
            agent.add_remote(bytes(metadata))
        outgoing = self._pending.get(tensor_id)
        if outgoing is None:
            return
        target = agent.agent.get_xfer_descs(
            [(address, size, device_id)], "VRAM" if kind == "cuda" else "DRAM"
        )
        local = agent.agent.get_xfer_descs(outgoing.tensor.reshape(-1).view(torch.int8))
        try:
            ok = await agent.run(local, target, remote, "WRITE", str(slot_id).encode())
        except Exception:
            logger.exception("NIXL WRITE of embeddings %d to %s failed", tensor_id, remote)
            ok = False
        self._finish(tensor_id, ok)


class RingBuffer:
    """Offsets into a buffer of ``size`` bytes, handed out in order and reclaimed from the
    oldest: contiguous allocations only; when the tail is too small the next one starts
    over at 0 if the oldest live allocation leaves room. Releases may come in any order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: deque[list[int]] = deque()  # [start, end, released]

    def allocate(self, nbytes: int) -> int | None:
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        if need > self.size:
            return None
        if not self._live:
            start = 0
        else:
            oldest, newest_end = self._live[0][0], self._live[-1][1]
            wrapped = self._live[-1][0] < oldest
            if not wrapped and newest_end + need <= self.size:
                start = newest_end
            elif not wrapped and need <= oldest:
                start = 0
            elif wrapped and newest_end + need <= oldest:
                start = newest_end
            else:
                return None
        self._live.append([start, start + need, 0])
        return start

    def release(self, start: int) -> None:
        for entry in self._live:
            if entry[0] == start and not entry[2]:
                entry[2] = 1
                break
        while self._live and self._live[0][2]:
            self._live.popleft()


class NixlWriteEmbeddingReceiver(AbstractEmbeddingReceiver):
    """Counterpart of :class:`NixlWriteEmbeddingSender`: it manages a ring buffer for
    senders to write the embeddings into, and answers each request with the slot.

    The buffer (``buffer_size`` bytes, 8 GiB by default as upstream; on the GPU when there
    is one, else in RAM) is allocated and registered on the first receive.
    """

    def __init__(
        self, buffer_size: int = 2 * 8 * 1024 * 1024 * 256 * 2, *, device: str | None = None
    ) -> None:
        self.buffer_size = buffer_size
        self._device = device or _default_device()
        self._agent: NixlAgent | None = None
        self._buffer: torch.Tensor | None = None
        self._ring = RingBuffer(buffer_size)
        self._ids = itertools.count()
        self._held: dict[int, int] = {}
        self._told_metadata: set[str] = set()

    def _ready(self) -> tuple[NixlAgent, torch.Tensor]:
        if self._agent is None or self._buffer is None:
            self._agent = NixlAgent("write-receiver")
            # Touched now: registering untouched pages makes the first transfers slow.
            self._buffer = torch.zeros(self.buffer_size, dtype=torch.int8, device=self._device)
            self._agent.agent.register_memory(self._buffer)
        return self._agent, self._buffer

    async def receive_embeddings(
        self,
        request: TransferRequest,
        receive_timeout: float = 60,
    ) -> tuple[int, torch.Tensor]:
        """Receive precomputed embeddings; TimeoutError when no buffer space frees up or the
        data does not arrive within ``receive_timeout`` seconds."""
        agent, buffer = self._ready()
        nixl_request = NixlTransferRequest.model_validate_json(request.serialized_request)
        sender = nixl_request.sender_agent_id
        if sender not in agent.remotes and nixl_request.agent_metadata:
            agent.add_remote(base64.b64decode(nixl_request.agent_metadata))
        size = nixl_request.tensor_size
        deadline = time.monotonic() + receive_timeout
        while (offset := self._ring.allocate(size)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no room for {size} bytes in the embedding buffer")
            await asyncio.sleep(0.005)
        slot_id = next(self._ids)
        slot = buffer[offset : offset + size]
        device_id = max(buffer.get_device(), 0)
        kind = "cuda" if buffer.is_cuda else "cpu"
        metadata = b"" if sender in self._told_metadata else agent.metadata()
        agent.agent.send_notif(
            sender,
            msgspec.msgpack.encode(
                [
                    nixl_request.tensor_id,
                    [slot.data_ptr(), size, device_id, kind],
                    slot_id,
                    metadata,
                ]
            ),
        )
        self._told_metadata.add(sender)
        tag = str(slot_id).encode()
        while not agent.take(sender, tag):
            if time.monotonic() > deadline:
                self._ring.release(offset)
                raise TimeoutError(f"embeddings from {sender} did not arrive in time")
            await asyncio.sleep(_POLL_S)
        self._held[slot_id] = offset
        return slot_id, _as(slot, request)

    def release_tensor(self, tensor_id: int) -> None:
        offset = self._held.pop(tensor_id, None)
        if offset is not None:
            self._ring.release(offset)


class NixlReadEmbeddingSender(_NixlSender):
    """NIXL READ based embedding transfer sender: the request carries the registered
    tensor's address; the receiver's READ notification frees it."""

    role = "read-sender"

    def _serialize(self, agent: NixlAgent, tensor_id: int, tensor: torch.Tensor) -> Any:
        mem_type, device_id = mem_type_of(tensor)
        return {
            "agent_name": agent.name,
            "agent_metadata": base64.b64encode(agent.metadata()).decode(),
            "tensor_id": tensor_id,
            "address": tensor.data_ptr(),
            "size": tensor.nbytes,
            "device_id": device_id,
            "mem_type": mem_type,
        }

    async def _on_notification(self, agent: NixlAgent, remote: str, message: bytes) -> None:
        try:
            tensor_id = int(message)
        except ValueError:
            logger.warning("ignoring a malformed NIXL notification from %s", remote)
            return
        self._finish(tensor_id, True)


class NixlReadEmbeddingReceiver(AbstractEmbeddingReceiver):
    """NIXL READ based embedding transfer receiver.

    ``max_items`` slots of ``max_item_mm_token * embedding_hidden_size`` bytes are
    registered on the first receive and reused; a tensor that doesn't fit one, or arrives
    when all are taken, gets a temporary buffer registered for it alone.
    """

    def __init__(
        self,
        embedding_hidden_size: int = 8 * 1024,
        max_item_mm_token: int = 1024,
        max_items: int = 1024,
        *,
        device: str | None = None,
    ) -> None:
        self.slot_size = max_item_mm_token * embedding_hidden_size
        self.max_items = max_items
        self._device = device or _default_device()
        self._agent: NixlAgent | None = None
        self._free: list[torch.Tensor] = []
        self._ids = itertools.count()
        self._held: dict[int, tuple[torch.Tensor, Any]] = {}

    def _ready(self) -> NixlAgent:
        if self._agent is None:
            self._agent = NixlAgent("read-receiver")
            if self.max_items:
                pool = torch.zeros(
                    self.max_items, self.slot_size, dtype=torch.int8, device=self._device
                )
                self._agent.agent.register_memory(pool)
                self._free = list(pool.unbind(0))
        return self._agent

    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        agent = self._ready()
        source = dict(request.serialized_request)
        # Refreshed every time: the sender registered this tensor after any earlier copy.
        sender = agent.add_remote(base64.b64decode(source["agent_metadata"]))
        size = int(source["size"])
        registration = None
        if size <= self.slot_size and self._free:
            buffer = self._free.pop()
        else:
            buffer = torch.zeros(size, dtype=torch.int8, device=self._device)
            registration = agent.agent.register_memory(buffer)
        target = buffer[:size]
        remote = agent.agent.get_xfer_descs(
            [(int(source["address"]), size, int(source["device_id"]))], source["mem_type"]
        )
        tag = str(source["tensor_id"]).encode()
        ok = await agent.run(agent.agent.get_xfer_descs(target), remote, sender, "READ", tag)
        tensor_id = next(self._ids)
        self._held[tensor_id] = (buffer, registration)
        if not ok:
            self.release_tensor(tensor_id)
            raise RuntimeError(f"NIXL READ of embeddings from {sender} failed")
        return tensor_id, _as(target, request)

    def release_tensor(self, tensor_id: int) -> None:
        held = self._held.pop(tensor_id, None)
        if held is None:
            return
        buffer, registration = held
        if registration is None:
            self._free.append(buffer)
        else:
            assert self._agent is not None
            self._agent.agent.deregister_memory(registration)


def create_embedding_sender(mode: EmbeddingTransferMode | str) -> AbstractEmbeddingSender:
    senders: dict[EmbeddingTransferMode, type[AbstractEmbeddingSender]] = {
        EmbeddingTransferMode.LOCAL: LocalEmbeddingSender,
        EmbeddingTransferMode.NIXL_WRITE: NixlWriteEmbeddingSender,
        EmbeddingTransferMode.NIXL_READ: NixlReadEmbeddingSender,
    }
    return senders[EmbeddingTransferMode(mode)]()


def create_embedding_receiver(mode: EmbeddingTransferMode | str) -> AbstractEmbeddingReceiver:
    mode = EmbeddingTransferMode(mode)
    if mode is EmbeddingTransferMode.LOCAL:
        return LocalEmbeddingReceiver()
    if mode is EmbeddingTransferMode.NIXL_WRITE:
        return NixlWriteEmbeddingReceiver()
    return NixlReadEmbeddingReceiver(max_items=0)
