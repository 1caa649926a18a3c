"""Whether the transformers engine's memory is bounded by its KV pool: ``--requests``
greedy requests of ``--prompt`` + ``--answer`` tokens (``ignore_eos``) sent at once to
the default model (SmolLM2-135M-Instruct) with a ``--pool``-token KV pool, one thread;
prints whether all complete, the preemptions, and the process's peak RSS (sampled every
50 ms) over its RSS once the engine started, beside the pool's own KV size; ``--rounds``
sends that many batches of new requests one after another, each round's peak printed.

    .venv/bin/python bench/kv_rss.py [--pool 2048] [--requests 8] [--prompt 400] [--answer 300]
        [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer

from bench.engine_core import greedy, start, timed
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import prepare_default_model


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=400)
    parser.add_argument("--answer", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model_dir = await prepare_default_model(default_model_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = await start(model_dir, 1, "--kv-cache-tokens", str(args.pool))
    config = engine.scheduler.runner.model.config  # type: ignore[union-attr]
    head_dim = config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    started = peak = rss_mb()

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mb())
            await asyncio.sleep(0.05)

    try:
        for round_index in range(args.rounds):
            requests = []
            for index in range(args.requests):
                text = " ".join(
                    f"Note {j}-{index}-{round_index}: keep the receipt." for j in range(args.prompt)
                )
                request = greedy(tokenizer(text)["input_ids"][: args.prompt], args.answer)
                request["stop_conditions"]["ignore_eos"] = True
                requests.append(request)
            watcher = asyncio.create_task(watch())
            try:
                answers = await asyncio.gather(*(timed(engine, request) for request in requests))
            finally:
                watcher.cancel()
            usage = engine.scheduler.usage()  # type: ignore[union-attr]
            complete = sum(len(tokens) == args.answer for _, tokens, _ in answers)
            print(
                f"pool {args.pool} tokens ({args.pool * token_bytes / 2**20:.0f} MB of float32 "
                f"KV), round {round_index + 1}: {args.requests} requests of {args.prompt} + "
                f"{args.answer} tokens: {complete} complete, {usage.preemptions} preemptions so "
                f"far; RSS {started:.0f} MB once started, peak so far {peak:.0f} MB "
                f"(+{peak - started:.0f} MB)",
                flush=True,
            )
    finally:
        await engine.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
