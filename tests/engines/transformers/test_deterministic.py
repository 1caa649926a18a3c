"""``--deterministic`` inside the engine: a prompt cut into chunks, several choices, and a
request whose choices are sampled, each held against the trainer's forward pass."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import Choice, run

LONG_PROMPT = [(7 * i) % 90 + 5 for i in range(80)]


def sampled(prompt: list[int], *, n: int = 1, top: int = 0) -> dict[str, Any]:
    return {
        "token_ids": prompt,
        "sampling_options": {"temperature": 1.0, "seed": 5, "n": n},
        "stop_conditions": {"max_tokens": 10, "ignore_eos": True},
        "output_options": {"logprobs": top},
    }


def trainer_rows(
    model_dir: Path, token_ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits.float(), -1)[0]


def logprobs(choice: Choice) -> list[float]:
    return [value for chunk in choice.chunks for value in chunk.get("log_probs", [])]


def assert_trainers(
    model_dir: Path, prompt: list[int], choice: Choice, dtype: torch.dtype = torch.float32
) -> None:
    rows = trainer_rows(model_dir, prompt + choice.token_ids, dtype)
    start = len(prompt) - 1
    expected = [float(rows[start + i, t]) for i, t in enumerate(choice.token_ids)]
    assert logprobs(choice) == expected


async def test_a_chunked_prompt_answers_as_a_whole_one(tiny_model_dir: Path) -> None:
    # bfloat16: where a chunk's rounding would show in the sampled tokens.
    mode = ("--deterministic", "--dtype", "bfloat16")
    chunked = await start_engine(tiny_model_dir, *mode, "--max-num-batched-tokens", "16")
    try:
        # Decode rows beside the long prompt change the budget left for its chunks.
        beside = [run(chunked, sampled([9 + i, 10, 11])) for i in range(3)]
        first, *_ = await asyncio.gather(run(chunked, sampled(LONG_PROMPT)), *beside)
    finally:
        await chunked.cleanup()
    whole = await start_engine(tiny_model_dir, *mode)
    try:
        alone = await run(whole, sampled(LONG_PROMPT))
    finally:
        await whole.cleanup()
    assert first[0].token_ids == alone[0].token_ids
    assert logprobs(first[0]) == logprobs(alone[0])
    assert_trainers(tiny_model_dir, LONG_PROMPT, alone[0], torch.bfloat16)


async def test_every_choice_gets_the_trainers_logprobs(tiny_model_dir: Path) -> None:
    engine = await start_engine(tiny_model_dir, "--deterministic")
    try:
        prompt = [5, 6, 7, 8, 9]
        choices = await run(engine, sampled(prompt, n=3, top=2))
    finally:
        await engine.cleanup()
    assert len(choices) == 3
    for choice in choices.values():
        assert_trainers(tiny_model_dir, prompt, choice)
        rows = trainer_rows(tiny_model_dir, prompt + choice.token_ids)
        tops = [top for chunk in choice.chunks for top in chunk.get("top_logprobs", [])]
        for position, top in enumerate(tops):
            best = rows[len(prompt) - 1 + position].topk(2)
            assert [entry["token_id"] for entry in top] == best.indices.tolist()
            assert [entry["logprob"] for entry in top] == best.values.tolist()
