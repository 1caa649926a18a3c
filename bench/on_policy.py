"""On-policy logprobs: how far ``/generate``'s ``return_logprob`` is from a trainer's
forward pass, and what ``--deterministic`` costs.

For float32 and bfloat16, the default mode and ``--deterministic``: a real ``penstock
serve`` (transformers engine, one CPU thread) on a tiny random Llama checkpoint (or
``--model``), requests of ``--tokens`` sampled tokens (seeded) one at a time and then 16
at once. Each answer's logprobs are held against the trainer's recomputation in this
process, ``log_softmax(model(prompt + completion).logits.float())`` with the same
checkpoint and dtype; the table gives the largest |difference| and the tokens/s.

    .venv/bin/python bench/on_policy.py [--tokens 32] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import torch
from transformers import AutoModelForCausalLM

from tests.support.server import transformers_server
from tests.support.tiny_llm import build_tiny_llama

CONCURRENCY = (1, 16)


def prompt(index: int) -> list[int]:
    """Prompts of different lengths and tokens, so a batch mixes them."""
    return [5 + index, 30 + index % 7, 7, 8 + index % 5] * (1 + index % 4)


async def one(client: httpx.AsyncClient, index: int, tokens: int) -> tuple[list[int], Any]:
    body = {
        "input_ids": prompt(index),
        "sampling_params": {
            "max_new_tokens": tokens,
            "temperature": 1.0,
            "seed": index,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    response = await client.post("/generate", json=body)
    response.raise_for_status()
    answer = response.json()
    return prompt(index) + answer["output_ids"], answer["meta_info"]["output_token_logprobs"]


async def run(base_url: str, concurrency: int, tokens: int) -> tuple[list[Any], float]:
    """``concurrency`` requests at once (after one warm-up): answers and tokens/s."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await one(client, 99, 4)
        started = time.perf_counter()
        if concurrency == 1:
            answers = [await one(client, index, tokens) for index in range(4)]
        else:
            answers = list(
                await asyncio.gather(*(one(client, i, tokens) for i in range(concurrency)))
            )
        elapsed = time.perf_counter() - started
    produced = sum(len(logprobs) for _, logprobs in answers)
    return answers, produced / elapsed


def largest_difference(trainer: Any, answers: list[Any]) -> float:
    largest = 0.0
    with torch.inference_mode():
        for ids, logprobs in answers:
            logits = trainer(torch.tensor([ids])).logits
            expected = torch.log_softmax(logits.float(), -1)[0]
            start = len(ids) - len(logprobs) - 1
            for position, (logprob, token, _) in enumerate(logprobs):
                largest = max(largest, abs(logprob - float(expected[start + position, token])))
    return largest


def measure(model_dir: Path, dtype: str, deterministic: bool, tokens: int) -> list[str]:
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    mode = "--deterministic" if deterministic else "default"
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        gateway = ["--deterministic"] if deterministic else []
        engine = ("--dtype", dtype, "--cpu-weight-dtype", "float32")
        with transformers_server(model_dir, Path(logs), *gateway, engine_args=engine) as server:
            for concurrency in CONCURRENCY:
                answers, rate = asyncio.run(run(server.base_url, concurrency, tokens))
                difference = largest_difference(trainer, answers)
                rows.append(f"| {dtype} | {mode} | {concurrency} | {difference:.3g} | {rate:.0f} |")
                print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a tiny Llama)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| dtype | mode | concurrency | max abs(logprob - trainer) | tokens/s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        model_dir = args.model or build_tiny_llama(Path(folder) / "tiny-llama")
        for dtype in ("float32", "bfloat16"):
            for deterministic in (False, True):
                measure(model_dir, dtype, deterministic, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
