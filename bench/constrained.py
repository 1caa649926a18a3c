"""What a JSON-schema constraint costs the transformers engine's decode, beside free rows.

Starts the engine once on the default model (SmolLM2-135M-Instruct, its 49k-token
vocabulary: the bitmask's real width) and times, in turn each round, at concurrency 1
and ``--concurrency``: free greedy decoding of ``--tokens`` tokens (``ignore_eos``), and
greedy decoding held to a JSON schema (a list of records), which ends where the grammar
does. Each row reports decode tokens/s over the whole requests (prefill included, the
same prompt everywhere) and the tokens per request. The grammar is compiled once before
the rounds (it is cached by its schema), so the rows time the per-step work: the bitmask
fill, its application to the logits and the matcher's advance.

    .venv/bin/python bench/constrained.py [--rounds 3] [--tokens 64] [--concurrency 8]
        [--threads 1] [--free-only]

``--free-only`` runs the free rows alone, so the same command measures a tree without
constrained decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine

PROMPT = "List some cities with their country and population as JSON."
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "country": {"type": "string", "maxLength": 16},
                    "population": {"type": "integer"},
                },
                "required": ["name", "country", "population"],
            },
        }
    },
    "required": ["cities"],
}


def request(prompt: list[int], tokens: int, constrained: bool) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": 0.0}
    if constrained:
        sampling["guided_decoding"] = {"json": SCHEMA}
    return {
        "token_ids": prompt,
        "sampling_options": sampling,
        "stop_conditions": {"max_tokens": tokens, "ignore_eos": not constrained},
    }


async def one(engine: TransformersEngine, body: dict[str, Any]) -> int:
    count = 0
    async for chunk in engine.generate(body, Context()):
        count += len(chunk["token_ids"])
    return count


async def timed(engine: TransformersEngine, body: dict[str, Any], concurrency: int) -> tuple:
    started = time.perf_counter()
    counts = await asyncio.gather(*(one(engine, body) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return sum(counts) / elapsed, sum(counts) / concurrency


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--free-only", action="store_true")
    args = parser.parse_args()
    engine, _ = await TransformersEngine.from_args(["--cpu-threads", str(args.threads)])
    await engine.start(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.model_path, local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    kinds = [False] if args.free_only else [False, True]
    rows = [(kind, c) for kind in kinds for c in (1, args.concurrency)]
    for kind, c in rows:  # warm-up; compiles the grammar once
        await timed(engine, request(prompt, args.tokens, kind), c)
    results: dict[tuple[bool, int], list[tuple[float, float]]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for kind, c in rows:
            results[kind, c].append(await timed(engine, request(prompt, args.tokens, kind), c))
    print("| | tokens/s | tokens per request |")
    print("|---|---:|---:|")
    for (kind, c), runs in results.items():
        speeds = [speed for speed, _ in runs]
        name = "JSON schema" if kind else "free"
        print(
            f"| {name}, c{c} | {statistics.median(speeds):.1f} "
            f"[{', '.join(f'{s:.1f}' for s in speeds)}] | {runs[0][1]:.0f} |"
        )
    await engine.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
