"""What a chunk of a long prompt adds to a decode step it rides in, by its size and by how
much of the prompt is already computed: one ``LlamaDecoder.step`` of the default model
(SmolLM2-135M-Instruct) on the CPU, a row of ``--row`` tokens decoding beside a chunk of
``n`` tokens over ``ctx`` prompt tokens (random KV), against the row's step alone; each
figure the lower quartile of 7 steps.

    .venv/bin/python bench/chunk_cost.py [--threads 1] [--row 300] [--contexts 1000,4000,7500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.engine_core import start
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE
from penstock.engines.transformers.core.kv_cache import KvArena, StepKv
from penstock.engines.transformers.core.llama_decode import LlamaDecoder
from penstock.engines.transformers.core.prompt_kv import PromptChunk, PromptKv
from penstock.engines.transformers.default_model import prepare_default_model

CHUNKS = (1, 2, 4, 8, 16, 32, 64)


def low_quartile_ms(step: Callable[[], None], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 4] * 1000


def fused_step(
    decoder: LlamaDecoder,
    row: tuple[KvArena, list[int], int],
    prompt: PromptKv,
    context: int,
    tokens: int,
) -> None:
    """The ``row`` (its arena, blocks and length) decodes a token beside ``tokens`` tokens
    of ``prompt`` from ``context``; both are then as long as before."""
    for layer in prompt.layers:
        layer.end = context
    ids = torch.randint(0, 1000, (tokens,))
    chunk = PromptChunk(ids, context, prompt, False) if tokens else None
    arena, blocks, length = row
    kv = StepKv(arena, [(blocks, length)])
    decoder.step(torch.tensor([5]), torch.tensor([length]), kv, chunk)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--row", type=int, default=300)
    parser.add_argument("--contexts", default="1000,4000,7500")
    args = parser.parse_args()
    engine = await start(await prepare_default_model(default_model_cache_dir()), args.threads)
    assert engine.scheduler is not None
    decoder = engine.scheduler.runner.decoder
    assert decoder is not None, "the default model decodes with LlamaDecoder"
    model = engine.scheduler.runner.model
    layers = len(model.model.layers)
    shape = (1, decoder.kv_heads, args.row, decoder.head_dim)
    blocks = list(range(args.row // BLOCK_SIZE + 1))
    arena = KvArena.for_model(model.config, len(blocks), torch.float32, torch.device("cpu"))
    row_kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]
    arena.write_prompt(arena.slots(blocks, 0, args.row), row_kv, 0)
    row = (arena, blocks, args.row)
    try:
        with torch.inference_mode():
            for context in (int(part) for part in args.contexts.split(",")):
                prompt = PromptKv(layers, context + max(CHUNKS))
                filled = (1, decoder.kv_heads, context, decoder.head_dim)
                for index in range(layers):
                    prompt.update(torch.randn(filled), torch.randn(filled), index)

                def step(tokens: int, prompt: PromptKv = prompt, context: int = context) -> None:
                    fused_step(decoder, row, prompt, context, tokens)

                alone = low_quartile_ms(lambda: step(0))
                added = " ".join(
                    f"{n}: +{low_quartile_ms(lambda n=n: step(n)) - alone:.1f}" for n in CHUNKS
                )
                print(
                    f"ctx {context}: the row's step alone {alone:.1f} ms; added by n tokens {added}"
                )
    finally:
        await engine.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
