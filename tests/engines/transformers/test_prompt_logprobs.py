"""vLLM's ``prompt_logprobs`` gathered chunk by chunk: alone (prefill chunks of their own)
and beside a decoding row (chunks in its decode pass), each position's logprob, rank and
most likely tokens are those of transformers' own forward pass over the prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.helpers import greedy, run

# Several chunks of the most tokens a chunk keeping every logit computes (128).
PROMPT = [(11 * i) % 1_800 + 30 for i in range(300)]


def reference(model_dir: Path) -> list[Any]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        rows = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].float(), dim=-1)
    return [(rows[i], PROMPT[i + 1]) for i in range(len(PROMPT) - 1)]


def check(positions: list[Any], expected: list[Any], top: int) -> None:
    assert positions[0] is None and len(positions) == len(PROMPT)
    for entries, (row, token) in zip(positions[1:], expected, strict=True):
        own = entries[0]
        assert own["token_id"] == token
        assert abs(own["logprob"] - float(row[token])) < 1e-4
        assert own["rank"] == int((row > row[token]).sum()) + 1
        best = row.topk(top).indices.tolist()
        assert [e["token_id"] for e in entries[1:]] == [t for t in best if t != token]


async def prompt_logprobs(engine: TransformersEngine, top: int) -> list[Any]:
    request = {**greedy(PROMPT, max_tokens=1), "output_options": {"prompt_logprobs": top}}
    chunks = (await run(engine, request))[0].chunks
    return next(chunk["prompt_logprobs"] for chunk in chunks if "prompt_logprobs" in chunk)


async def test_prompt_logprobs_alone_and_beside_a_decoding_row_are_the_models(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    expected = reference(tiny_model_dir)
    check(await prompt_logprobs(engine, 3), expected, 3)
    decoding = asyncio.ensure_future(run(engine, greedy(max_tokens=120)))
    await asyncio.sleep(0.05)
    beside = await prompt_logprobs(engine, 3)
    await decoding
    check(beside, expected, 3)
