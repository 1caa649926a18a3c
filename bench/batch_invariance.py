"""Batch invariance of greedy decoding: 8 requests alone and at once against ``generate``.

For the tests' tiny float32 Llama (``--batches`` sets of 8 token-id prompts) and the default
model (SmolLM2-135M, where it is converted, on its lossless default path; 8 chat questions),
8 greedy requests run through the transformers engine one at a time, then all at once, and
each is held against transformers' own ``generate`` (float32, one request). Both stop at the
end token or after ``--tokens``, and neither applies the checkpoint's repetition penalty
(``generate`` would; ``min_new_tokens`` would mask the end token, so neither is used).

At the first token where two answers differ (their prefixes equal), a line gives the logit
margin there (top-1 minus top-2) on each side (the engine's from its top-2 logprobs, which
differ by as much as the logits do), and how far the engine's logprobs were from
``generate``'s along the shared prefix: a divergence at a margin within that distance is
the rounding of a near tie, one at a wider margin an error.

    .venv/bin/python bench/batch_invariance.py [--tokens 64] [--batches 4]
        [--skip-default-model] [--deterministic] [--engine-args "--cpu-threads 1"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME
from tests.support.tiny_llm import build_tiny_llama

REQUESTS = 8
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colours.",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
    "What does HTTP stand for?",
]


@dataclass
class Answer:
    """A greedy answer, with the top-2 logits' margin and the chosen logprob per token."""

    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def tiny_prompts(batch: int) -> list[list[int]]:
    """Token ids of different lengths (3 to 38), so the batch mixes them."""
    return [
        [(7 * i + 13 * j + 101 * batch) % 1900 + 50 for j in range(3 + 5 * i)]
        for i in range(REQUESTS)
    ]


def chat_prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for question in QUESTIONS
    ]


def reference(model_dir: Path, prompts: list[list[int]], tokens: int) -> list[Answer]:
    """``generate``'s greedy answers, float32, one request at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=tokens,
                do_sample=False,
                repetition_penalty=1.0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            answer = Answer(tokens=out.sequences[0, len(prompt) :].tolist())
            for logits in out.logits:
                top = logits[0].float().topk(2).values
                answer.margins.append(float(top[0] - top[1]))
                answer.logprobs.append(float(logits[0].float().log_softmax(-1).max()))
            answers.append(answer)
    return answers


async def engine_answer(engine: TransformersEngine, prompt: list[int], tokens: int) -> Answer:
    request = {
        "token_ids": prompt,
        "sampling_options": {"temperature": 0.0, "repetition_penalty": 1.0},
        "stop_conditions": {"max_tokens": tokens},
        "output_options": {"logprobs": 2},
    }
    answer = Answer()
    async for chunk in engine.generate(request, Context()):
        answer.tokens += chunk["token_ids"]
        for top in chunk.get("top_logprobs", []):
            answer.margins.append(top[0]["logprob"] - top[1]["logprob"])
            answer.logprobs.append(top[0]["logprob"])
    return answer


async def engine_answers(
    model_dir: Path, prompts: list[list[int]], tokens: int, engine_args: list[str]
) -> tuple[list[Answer], list[Answer], str]:
    engine, _ = await TransformersEngine.from_args(
        ["--model", str(model_dir), "--max-num-seqs", str(REQUESTS), *engine_args]
    )
    await engine.start(0)
    try:
        weights = str(engine.model.lm_head.weight.dtype).removeprefix("torch.")
        alone = [await engine_answer(engine, prompt, tokens) for prompt in prompts]
        together = list(
            await asyncio.gather(*(engine_answer(engine, prompt, tokens) for prompt in prompts))
        )
    finally:
        await engine.cleanup()
    return alone, together, f"{weights} weights, {torch.get_num_threads()} threads"


def first_difference(answer: Answer, wanted: Answer) -> int | None:
    """The first token where the answers differ (or one has ended), None when equal."""
    if answer.tokens == wanted.tokens:
        return None
    pairs = enumerate(zip(answer.tokens, wanted.tokens, strict=False))
    shorter = min(len(answer.tokens), len(wanted.tokens))
    return next((i for i, (a, b) in pairs if a != b), shorter)


def largest_gap(answer: Answer, wanted: Answer, until: int | None) -> float:
    """The largest |difference| of the chosen tokens' logprobs over the shared prefix."""
    pairs = zip(answer.logprobs[:until], wanted.logprobs[:until], strict=False)
    return max((abs(a - b) for a, b in pairs), default=0.0)


def divergence(answer: Answer, wanted: Answer) -> str:
    first = first_difference(answer, wanted)
    if first is None:
        return "equal"

    def at(side: Answer) -> str:
        if first >= len(side.tokens):
            return "(ended)"
        return f"{side.tokens[first]} (margin {side.margins[first]:.2e})"

    return f"token {first}: {at(answer)} against {at(wanted)}"


@dataclass
class Tally:
    """How many answers were equal, and the figures that say why the others were not."""

    requests: int = 0
    equal: dict[str, int] = field(default_factory=dict)
    gap: float = 0.0
    smallest_margin: float = float("inf")
    lines: list[str] = field(default_factory=list)

    def add(self, expected: list[Answer], alone: list[Answer], together: list[Answer]) -> None:
        comparisons = {
            "alone == generate": (alone, expected),
            "together == alone": (together, alone),
            "together == generate": (together, expected),
        }
        for label, (answers, wanted) in comparisons.items():
            for index, (answer, reference) in enumerate(zip(answers, wanted, strict=True)):
                first = first_difference(answer, reference)
                self.equal[label] = self.equal.get(label, 0) + (first is None)
                if first is not None:
                    request = self.requests + index
                    self.lines.append(
                        f"  {label:<21} request {request}: {divergence(answer, reference)}"
                    )
                if wanted is expected:
                    self.gap = max(self.gap, largest_gap(answer, reference, first))
        self.smallest_margin = min(self.smallest_margin, *(min(a.margins) for a in expected))
        self.requests += len(expected)

    def print(self, name: str, setup: str) -> None:
        print(f"## {name} ({setup})")
        for label, count in self.equal.items():
            print(f"{label:<21}: {count}/{self.requests}")
        print(f"smallest top-1 margin along generate's answers: {self.smallest_margin:.2e}")
        print(f"largest |logprob - generate's| before any difference: {self.gap:.1e}")
        print("\n".join(self.lines), end="\n\n" if self.lines else "\n")


def measure(
    name: str, model_dir: Path, batches: list[list[list[int]]], tokens: int, args: list[str]
) -> None:
    tally, setup = Tally(), ""
    for prompts in batches:
        expected = reference(model_dir, prompts, tokens)
        alone, together, setup = asyncio.run(engine_answers(model_dir, prompts, tokens, args))
        tally.add(expected, alone, together)
    tally.print(name, setup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4, help="tiny model: sets of 8 prompts")
    parser.add_argument("--skip-default-model", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="passed to the engine")
    parser.add_argument("--engine-args", default="", help="more engine options, one string")
    args = parser.parse_args()
    engine_args = shlex.split(args.engine_args) + (
        ["--deterministic"] if args.deterministic else []
    )
    with tempfile.TemporaryDirectory() as folder:
        tiny = build_tiny_llama(Path(folder) / "tiny-llama")
        batches = [tiny_prompts(batch) for batch in range(args.batches)]
        measure("tiny float32 Llama", tiny, batches, args.tokens, engine_args)
    default = default_model_cache_dir() / DEFAULT_MODEL_NAME
    if not args.skip_default_model:
        if (default / ".penstock-complete").exists():
            prompts = [chat_prompts(default)]
            measure(DEFAULT_MODEL_NAME, default, prompts, args.tokens, engine_args)
        else:
            print(f"{DEFAULT_MODEL_NAME} is not converted in {default.parent}: skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
