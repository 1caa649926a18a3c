"""The receiving process of the embedding transfer tests (started with ``spawn``)."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any


def serve(conn: Connection) -> None:
    """Receive each request sent down ``conn``; answer with what arrived, then release it."""
    import torch

    from penstock.multimodal.transfer import (
        AbstractEmbeddingReceiver,
        NixlReadEmbeddingReceiver,
        NixlWriteEmbeddingReceiver,
        TransferRequest,
        create_embedding_receiver,
    )

    receivers: dict[str, AbstractEmbeddingReceiver] = {
        "local": create_embedding_receiver("local"),
        # Small, so the test stays light: a 1 MiB ring and two 64 KiB slots.
        "nixl-write": NixlWriteEmbeddingReceiver(1 << 20),
        "nixl-read": NixlReadEmbeddingReceiver(1024, 64, 2),
    }
    loop = asyncio.new_event_loop()
    while True:
        message: Any = conn.recv()
        if message is None:
            break
        mode, payload = message
        receiver = receivers[mode]
        try:
            request = TransferRequest.model_validate_json(payload)
            tensor_id, tensor = loop.run_until_complete(receiver.receive_embeddings(request))
            raw = tensor.contiguous().reshape(-1).view(torch.uint8)
            answer = (list(tensor.shape), str(tensor.dtype), raw.numpy().tobytes())
            receiver.release_tensor(tensor_id)
            conn.send(answer)
        except Exception as exc:
            conn.send(repr(exc))
    loop.close()
