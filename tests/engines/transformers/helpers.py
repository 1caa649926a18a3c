"""Driving a started engine the way the gateway does, and reading its output back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def greedy(prompt: list[int] = PROMPT, max_tokens: int = 16, **stop: Any) -> dict[str, Any]:
    return {
        "token_ids": list(prompt),
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True, **stop},
    }


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


async def run(
    engine: TransformersEngine, request: dict[str, Any], context: Context | None = None
) -> dict[int, Choice]:
    """All choices of one request, checking each ends with exactly one terminal."""
    choices: dict[int, Choice] = {}
    async for chunk in engine.generate(request, context or Context()):
        choice = choices.setdefault(chunk["index"], Choice())
        assert choice.finish_reason is None, "chunk after the terminal"
        choice.chunks.append(chunk)
        choice.token_ids += chunk["token_ids"]
        if "finish_reason" in chunk:
            choice.finish_reason = chunk["finish_reason"]
            choice.usage = chunk["completion_usage"]
    return choices


async def tokens(engine: TransformersEngine, request: dict[str, Any]) -> list[int]:
    return (await run(engine, request))[0].token_ids


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens of transformers' own ``generate`` (end tokens ignored)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
