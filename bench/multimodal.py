"""Multimodal input costs: image load (data URL to RGB), a stand-in encode, embedding cache
hit latency, and embedding transfer throughput between two processes by mode and size.

    python bench/multimodal.py [--reps 5] [--sizes-mib 0.0625,1,16,64]

Prints one table per part (medians). Loopback only; the receiver is a spawned process.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import torch
from PIL import Image

from penstock.http import UrlValidationPolicy
from penstock.memory import CachedEmbedding, MultimodalEmbeddingCacheManager
from penstock.multimodal import AsyncEncoderCache, ImageLoader
from penstock.multimodal.transfer import (
    NixlReadEmbeddingReceiver,
    NixlWriteEmbeddingReceiver,
    TransferRequest,
    create_embedding_receiver,
    create_embedding_sender,
)

MIB = 1024 * 1024


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def data_url(side: int, fmt: str) -> str:
    pixels = np.random.default_rng(side).integers(0, 255, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


async def image_load(reps: int) -> None:
    loader = ImageLoader(cache_size=0, url_policy=UrlValidationPolicy(max_data_url_bytes=64 * MIB))
    print("| image | data URL size | load (decode to RGB) ms |")
    print("|---|---|---|")
    for side in (256, 1024, 2048):
        for fmt in ("PNG", "JPEG"):
            url = data_url(side, fmt)
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                await loader.load_image(url)
                times.append(time.perf_counter() - started)
            print(f"| {side}x{side} {fmt} | {len(url) / MIB:.2f} MiB | {_median_ms(times):.1f} |")


def encode_time(reps: int) -> None:
    """A ViT-style patch embedding (14x14 patches to 1024 wide) plus one attention layer:
    the shape of the work, not a real model."""
    torch.manual_seed(0)
    embed = torch.nn.Linear(14 * 14 * 3, 1024)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    print("\n| image | patches | stand-in encode ms |")
    print("|---|---|---|")
    for side in (224, 448):
        pixels = torch.rand(1, 3, side, side)
        times = []
        with torch.inference_mode():
            for _ in range(reps):
                started = time.perf_counter()
                patches = pixels.unfold(2, 14, 14).unfold(3, 14, 14)
                patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(1, -1, 14 * 14 * 3)
                layer(embed(patches))
                times.append(time.perf_counter() - started)
        print(f"| {side}x{side} | {(side // 14) ** 2} | {_median_ms(times):.1f} |")


async def cache_hits(reps: int) -> None:
    cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(1 << 30))
    entry = CachedEmbedding(torch.zeros(256, 1024))

    async def compute() -> CachedEmbedding:
        return entry

    await cache.get_or_compute("k", compute)
    n = 10000 * reps
    started = time.perf_counter()
    for _ in range(n):
        await cache.get_or_compute("k", compute)
    per_hit = (time.perf_counter() - started) / n
    print(f"\nembedding cache hit (AsyncEncoderCache.get_or_compute): {per_hit * 1e6:.2f} µs")


def receiver_process(conn: Connection, buffer_bytes: int) -> None:
    receivers = {
        "local": create_embedding_receiver("local"),
        "nixl-write": NixlWriteEmbeddingReceiver(buffer_bytes, device="cpu"),
        "nixl-read": NixlReadEmbeddingReceiver(max_items=0, device="cpu"),
    }
    loop = asyncio.new_event_loop()
    while (message := conn.recv()) is not None:
        mode, payload = message
        receiver = receivers[mode]
        tensor_id, tensor = loop.run_until_complete(
            receiver.receive_embeddings(TransferRequest.model_validate_json(payload))
        )
        checksum = float(tensor[:1].float().sum()) if tensor.numel() else 0.0
        receiver.release_tensor(tensor_id)
        conn.send(checksum)
    loop.close()


async def transfer(reps: int, sizes_mib: list[float]) -> None:
    ours, theirs = multiprocessing.Pipe()
    buffer = int(max(sizes_mib) * MIB) * 2 + MIB
    peer = multiprocessing.get_context("spawn").Process(
        target=receiver_process, args=(theirs, buffer), daemon=True
    )
    peer.start()
    print("\n| size | local (safetensors file) MiB/s | NIXL WRITE MiB/s | NIXL READ MiB/s |")
    print("|---|---|---|---|")
    try:
        senders = {m: create_embedding_sender(m) for m in ("local", "nixl-write", "nixl-read")}
        for size in sizes_mib:
            tensor = torch.randn(int(size * MIB) // 4)
            row = []
            for mode, sender in senders.items():
                times = []
                for _ in range(reps + 1):
                    started = time.perf_counter()
                    request, done = await sender.send_embeddings(tensor, stage_embeddings=True)
                    ours.send((mode, request.model_dump_json()))
                    checksum = await asyncio.to_thread(ours.recv)
                    await done
                    times.append(time.perf_counter() - started)
                    assert checksum == float(tensor[:1].sum())
                best = statistics.median(times[1:])  # the first includes connection setup
                row.append(f"{size / best:.0f}")
            label = f"{size * 1024:.0f} KiB" if size < 1 else f"{size:g} MiB"
            print(f"| {label} | " + " | ".join(row) + " |")
    finally:
        ours.send(None)
        peer.join(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes-mib", default="0.0625,1,16,64")
    args = parser.parse_args()
    await image_load(args.reps)
    encode_time(args.reps)
    await cache_hits(args.reps)
    await transfer(args.reps, [float(s) for s in args.sizes_mib.split(",")])


if __name__ == "__main__":
    asyncio.run(main())
