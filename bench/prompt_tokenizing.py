"""CPU per prompt of the preprocessor's ``encode``, for three shapes of chat prompt.

* short: one user message, a new one each time (what ``streaming_cost.py`` sends);
* long system prompt: ~1,000 characters of system prompt, then a new user message;
* conversation: twelve turns after that system prompt, the history growing by a turn a
  request, as a chat client resends it.

Each prompt is rendered with the sample tokenizer's chat template first; only ``encode``
is timed, after a warm-up. Run it once per tree to compare:

    PYTHONPATH=. .venv/bin/python bench/prompt_tokenizing.py
    PYTHONPATH=/tmp/penstock-before .venv/bin/python bench/prompt_tokenizing.py
"""

from __future__ import annotations

import time
from pathlib import Path

from penstock.preprocess import Preprocessor

SAMPLE_TOKENIZER = Path(__file__).resolve().parents[1] / "penstock/engines/assets/sample-tokenizer"
SYSTEM = (
    "You are a helpful assistant for a travel company. Answer briefly, cite the booking "
    "rules when they apply, and never invent prices. "
) * 8
WARM_UP = 500


def _cpu_us_per_prompt(preprocessor: Preprocessor, prompts: list[str]) -> float:
    for prompt in prompts[:WARM_UP]:
        preprocessor.encode(prompt)
    started = time.process_time()
    for prompt in prompts[WARM_UP:]:
        preprocessor.encode(prompt)
    return (time.process_time() - started) / (len(prompts) - WARM_UP) * 1e6


def main() -> None:
    preprocessor = Preprocessor.from_folder(SAMPLE_TOKENIZER)

    def render(messages: list[dict[str, str]]) -> str:
        return preprocessor.render_chat(messages, add_generation_prompt=True)

    def user(number: int) -> dict[str, str]:
        return {"role": "user", "content": f"Tell me story number {number}."}

    short = [render([user(n)]) for n in range(10_000)]
    system = [render([{"role": "system", "content": SYSTEM}, user(n)]) for n in range(3_000)]
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for turn in range(12):
        question = f"Question {turn}: what about day {turn} of the trip, and the hotel?"
        answer = f"On day {turn} you stay at hotel {turn}; breakfast is included. " * 3
        history += [{"role": "user", "content": question}]
        turns.append(render(history))
        history += [{"role": "assistant", "content": answer}]
    conversation = turns * 200
    print(f"short ({len(short[0])} chars): {_cpu_us_per_prompt(preprocessor, short):.1f} us")
    print(
        f"long system prompt ({len(system[0])} chars): "
        f"{_cpu_us_per_prompt(preprocessor, system):.1f} us"
    )
    print(
        f"conversation ({sum(map(len, turns)) // len(turns)} chars on average): "
        f"{_cpu_us_per_prompt(preprocessor, conversation):.1f} us"
    )


if __name__ == "__main__":
    main()
