"""Embeddings cross a real process boundary in every transfer mode, bytes, shapes and
dtypes intact; the sender learns when its memory is free."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from penstock.multimodal.transfer import (
    EmbeddingTransferMode,
    LocalEmbeddingReceiver,
    LocalEmbeddingSender,
    NixlReadEmbeddingReceiver,
    NixlWriteEmbeddingReceiver,
    RingBuffer,
    TransferRequest,
    create_embedding_receiver,
    create_embedding_sender,
    parse_dtype,
)
from tests.multimodal import transfer_peer

TENSORS = {
    "float32 3-d": lambda: torch.randn(3, 5, 7),
    "bfloat16": lambda: torch.randn(16, 24).to(torch.bfloat16),
    "int64": lambda: torch.arange(-5, 6, dtype=torch.int64),
    "float16, 256 KiB (no pooled READ slot fits)": lambda: torch.randn(512, 256).half(),
    "non-contiguous": lambda: torch.randn(6, 4).t(),
}


def exists(path: str) -> bool:
    return Path(path).exists()


@pytest.fixture(scope="module")
def peer() -> Iterator[Connection]:
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=transfer_peer.serve, args=(theirs,), daemon=True
    )
    process.start()
    yield ours
    ours.send(None)
    process.join(20)
    if process.is_alive():
        process.kill()


@pytest.mark.parametrize("mode", [m.value for m in EmbeddingTransferMode])
@pytest.mark.timeout(120)
async def test_embeddings_arrive_intact_in_another_process(mode: str, peer: Connection) -> None:
    sender = create_embedding_sender(mode)
    for name, make in TENSORS.items():
        tensor = make()
        for staged in (True, False):
            request, done = await sender.send_embeddings(tensor, stage_embeddings=staged)
            wire = request.model_dump_json()
            peer.send((mode, wire))
            answer = await asyncio.to_thread(peer.recv)
            assert not isinstance(answer, str), f"{name}: {answer}"
            shape, dtype, data = answer
            await asyncio.wait_for(done, 20)
            expected = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert (shape, dtype, data) == (list(tensor.shape), str(tensor.dtype), expected), name
            if mode == "local":
                assert not exists(request.serialized_request), "released, so deleted"


async def test_an_unstaged_send_is_done_at_once_and_keeps_its_copy() -> None:
    sender = create_embedding_sender(EmbeddingTransferMode.NIXL_READ)
    receiver = NixlReadEmbeddingReceiver(64, 4, 1)
    tensor = torch.arange(32, dtype=torch.float32)
    request, done = await sender.send_embeddings(tensor)
    assert done.done()
    tensor.zero_()
    tensor_id, got = await receiver.receive_embeddings(request)
    assert torch.equal(got, torch.arange(32, dtype=torch.float32))
    receiver.release_tensor(tensor_id)
    receiver.release_tensor(tensor_id)


async def test_a_write_receiver_times_out_when_no_sender_writes() -> None:
    sender = create_embedding_sender("nixl-write")
    request, _ = await sender.send_embeddings(torch.ones(4))
    receiver = NixlWriteEmbeddingReceiver(4096)
    # No room: the buffer is smaller than the tensor, so the wait runs out.
    big = request.model_copy(
        update={
            "serialized_request": request.serialized_request.replace(
                '"tensor_size":16', '"tensor_size":8192'
            )
        }
    )
    with pytest.raises(TimeoutError, match="no room"):
        await receiver.receive_embeddings(big, receive_timeout=0.05)
    tensor_id, got = await receiver.receive_embeddings(request, receive_timeout=10)
    assert torch.equal(got, torch.ones(4))
    receiver.release_tensor(tensor_id)


async def test_local_files_are_removed_on_release() -> None:
    request, done = await LocalEmbeddingSender().send_embeddings(torch.ones(2, 2))
    await done
    receiver = LocalEmbeddingReceiver()
    tensor_id, got = await receiver.receive_embeddings(request)
    assert torch.equal(got, torch.ones(2, 2)) and exists(request.serialized_request)
    receiver.release_tensor(tensor_id)
    assert not exists(request.serialized_request)
    receiver.release_tensor(999)


def test_the_factories_follow_the_mode() -> None:
    assert isinstance(create_embedding_receiver("local"), LocalEmbeddingReceiver)
    read = create_embedding_receiver(EmbeddingTransferMode.NIXL_READ)
    assert isinstance(read, NixlReadEmbeddingReceiver) and read.max_items == 0
    with pytest.raises(ValueError):
        create_embedding_sender("carrier-pigeon")


def test_unknown_dtype_names_read_back_as_float32() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("no_such_dtype") is torch.float32 and parse_dtype("Tensor") is torch.float32
    request = TransferRequest(
        embeddings_shape=[2], embedding_dtype_str="int8", serialized_request=1
    )
    assert TransferRequest.model_validate_json(request.model_dump_json()) == request


def test_the_ring_buffer_wraps_and_reclaims_out_of_order() -> None:
    ring = RingBuffer(256)
    a, b, c = ring.allocate(64), ring.allocate(64), ring.allocate(64)
    assert (a, b, c) == (0, 64, 128)
    assert ring.allocate(128) is None  # 64 left at the tail, nothing free at the head
    ring.release(b)
    assert ring.allocate(128) is None  # b is free, but a (older) still holds the head
    ring.release(a)
    assert ring.allocate(100) == 0  # the tail is too small: wraps to the freed start
    assert ring.allocate(64) is None  # would run into c
    ring.release(c)
    assert ring.allocate(512) is None
    assert ring.allocate(1) == 128
