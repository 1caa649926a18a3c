"""The transformers engine's KV core on the default model (SmolLM2-135M-Instruct), in one
process: prefix caching, shared prefills, and how many requests decode at once.

1. A chat request whose ~1,500-token system prompt was seen before (another question
   after it): TTFT cold vs warm, ``cached_tokens``, and the greedy answer with caching on
   and off (a second engine started with ``--no-enable-prefix-caching``).
2. Eight separate requests with one 1,000-token prompt, sent at once, then one request
   with ``n=8``: prompt tokens the engine computed (its prefill counter).
3. Requests of ``max_tokens`` 512 with short answers (each stream closed after
   ``--short`` tokens, once every request has its first token): the most requests
   decoding at once, beside what a reservation of ``prompt + max_tokens`` per request
   would let run in the same pool.
4. A stream decoding while a ``--long``-token prompt is prefilled beside it, then while
   that prompt decodes 32 tokens beside it: the stream's median and longest inter-token
   gap in each part, per ``--max-num-batched-tokens`` in ``--budgets`` (and the engine's
   ``--decode-gap-ratio`` when given). The stream grows by a token a step for the whole
   prefill, and its own step with it, so its gaps are set against its median gap during
   the prefill and its gap alone once the prompt has ended (16 more tokens), beside the
   gap of its first tokens. The prompt's TTFT is set against the same prompt's alone, in
   the same engine once the stream has ended (its blocks flushed from the cache).
5. The second turn of a conversation as a multi-turn rollout sends it, in token ids (a
   ~600-token system prompt, a 128-token greedy answer, the next question): its TTFT and
   ``cached_tokens`` with caching on and off. The answer's own blocks are cached as it
   ends, so the turn computes little more than its new question.

    .venv/bin/python bench/engine_core.py [--threads 1] [--requests 48] [--short 48]
        [--long 8000] [--budgets 2048,256] [--decode-gap-ratio R] [--only 1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer

from bench.smollm2 import QUESTIONS
from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import prepare_default_model

POOL_TOKENS = 16384
# Tokens the long prompt of part 4 decodes beside the stream once prefilled.
LONG_DECODES = 32
# Tokens the stream decodes alone after the long prompt ends: its gap at its own length.
ALONE_AFTER = 16
# The stream's prompt and answer in part 4: the model's context length.
STREAM_CONTEXT = 8192
LONG_ANSWER_QUESTION = "List twenty tools a plumber carries, one per line, with what each is for."
SYSTEM_SENTENCE = (
    "You are a careful assistant for a hardware store; answer briefly, name the aisle, "
    "and never invent a product the store does not carry. "
)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"])


def greedy(prompt: list[int], max_tokens: int, **sampling: Any) -> dict[str, Any]:
    return {
        "token_ids": prompt,
        "sampling_options": {"temperature": 0.0, **sampling},
        "stop_conditions": {"max_tokens": max_tokens},
    }


async def timed(engine: TransformersEngine, request: dict[str, Any]) -> tuple[float, list, dict]:
    """TTFT, the first choice's tokens and its usage."""
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    async for chunk in engine.generate(request, Context()):
        if first is None:
            first = time.perf_counter() - started
        if chunk["index"] == 0:
            tokens += chunk["token_ids"]
            usage = chunk.get("completion_usage") or usage
    assert first is not None
    return first, tokens, usage


def usage_of(engine: TransformersEngine) -> Any:
    assert engine.scheduler is not None
    return engine.scheduler.usage()


async def start(model_dir: Path, threads: int, *extra: str) -> TransformersEngine:
    engine, _ = await TransformersEngine.from_args(
        [
            "--model",
            str(model_dir),
            "--cpu-threads",
            str(threads),
            "--max-num-seqs",
            "64",
            "--kv-cache-tokens",
            str(POOL_TOKENS),
            *extra,
        ]
    )
    await engine.start(0)
    return engine


async def system_prompt_reuse(model_dir: Path, tokenizer: Any, threads: int) -> None:
    system = SYSTEM_SENTENCE * 50

    def chat(question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return chat_ids(tokenizer, messages)

    cold_prompt, warm_prompt = chat(QUESTIONS[0]), chat(QUESTIONS[1])
    answers = {}
    for caching in (True, False):
        flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
        engine = await start(model_dir, threads, flag)
        try:
            cold, cold_tokens, _ = await timed(engine, greedy(cold_prompt, 32))
            warm, warm_tokens, usage = await timed(engine, greedy(warm_prompt, 32))
        finally:
            await engine.cleanup()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        answers[caching] = (cold_tokens, warm_tokens)
        print(
            f"system prompt, caching {'on ' if caching else 'off'}: prompt {len(warm_prompt)} "
            f"tokens, TTFT cold {cold:.3f} s, seen before {warm:.3f} s "
            f"({warm / cold:.2f}x), cached_tokens {cached}"
        )
    same = answers[True] == answers[False]
    print(f"greedy answers identical with caching on and off: {same}")


async def shared_prompt(model_dir: Path, tokenizer: Any, threads: int) -> None:
    text = " ".join(f"Step {i}: tighten the bolt and check the washer." for i in range(120))
    prompt = tokenizer(text)["input_ids"][:1000]
    engine = await start(model_dir, threads)
    try:
        await asyncio.gather(*(timed(engine, greedy(prompt, 16)) for _ in range(8)))
        separate = usage_of(engine).prefill_tokens
        await engine.engine_control("flush_cache", {})
        await timed(engine, {**greedy(prompt, 16, n=8, temperature=0.8, seed=1)})
        one_request = usage_of(engine).prefill_tokens - separate
    finally:
        await engine.cleanup()
    print(
        f"8 separate requests, one {len(prompt)}-token prompt: {separate} prompt tokens "
        f"computed ({separate / len(prompt):.2f}x the prompt); n=8 in one request: "
        f"{one_request} ({one_request / len(prompt):.2f}x)"
    )


def next_turn_suffix(
    tokenizer: Any, messages: list[dict[str, str]], answer: list[int]
) -> list[int]:
    """The template's tokens after ``answer`` up to the next turn's generation prompt: a
    multi-turn rollout sends the answer's own token ids back, never re-tokenized text
    (which may split differently: ``":\n\n"`` comes back as two newline tokens)."""
    reply = tokenizer.decode(answer, skip_special_tokens=True)
    turn = [*messages, {"role": "assistant", "content": reply}]
    turn.append({"role": "user", "content": QUESTIONS[0]})
    text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    rest = text[text.rindex(reply) + len(reply) :]
    return list(tokenizer(rest, add_special_tokens=False)["input_ids"])


async def next_turn(model_dir: Path, tokenizer: Any, threads: int) -> None:
    messages = [
        {"role": "system", "content": SYSTEM_SENTENCE * 20},
        {"role": "user", "content": LONG_ANSWER_QUESTION},
    ]
    results = {}
    for caching in (True, False):
        flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
        engine = await start(model_dir, threads, flag)
        try:
            first = chat_ids(tokenizer, messages)
            _, answer, _ = await timed(engine, greedy(first, 128))
            prompt = first + answer + next_turn_suffix(tokenizer, messages, answer)
            ttft, tokens, usage = await timed(engine, greedy(prompt, 32))
        finally:
            await engine.cleanup()
        results[caching] = (ttft, tokens, usage["prompt_tokens_details"]["cached_tokens"])
        print(
            f"second turn, caching {'on ' if caching else 'off'}: prompt {len(prompt)} tokens "
            f"({len(answer)} of the first answer), TTFT {ttft:.3f} s, cached_tokens "
            f"{results[caching][2]}"
        )
    ratio = results[True][0] / results[False][0]
    same = results[True][1] == results[False][1]
    print(f"second turn TTFT with caching {ratio:.2f}x without; greedy answers identical: {same}")


async def decoding_at_once(
    model_dir: Path, tokenizer: Any, threads: int, requests: int, short: int
) -> None:
    engine = await start(model_dir, threads)
    peak = 0
    answering = 0
    all_answering = asyncio.Event()

    async def short_answer(question: str) -> int:
        nonlocal peak, answering
        prompt = chat_ids(tokenizer, [{"role": "user", "content": question}])
        request = {
            **greedy(prompt, 512),
            "stop_conditions": {"max_tokens": 512, "ignore_eos": True},
        }
        stream = engine.generate(request, Context())
        produced = 0
        try:
            async for chunk in stream:
                if not produced:
                    answering += 1
                    if answering == requests:
                        all_answering.set()
                produced += len(chunk["token_ids"])
                peak = max(peak, usage_of(engine).running)
                if produced >= short and all_answering.is_set():
                    break
        finally:
            await stream.aclose()
        return len(prompt)

    try:
        lengths = await asyncio.gather(
            *(short_answer(QUESTIONS[i % len(QUESTIONS)]) for i in range(requests))
        )
    finally:
        await engine.cleanup()
    reserved = POOL_TOKENS // (max(lengths) + 512)
    print(
        f"{requests} requests of max_tokens 512, answers of {short} tokens, pool "
        f"{POOL_TOKENS} tokens: at most {peak} decoding at once (a reservation of "
        f"prompt + max_tokens would allow {reserved})"
    )


async def gaps_beside_a_long_prompt(
    model_dir: Path, tokenizer: Any, threads: int, long: int, budget: int, *extra: str
) -> None:
    text = " ".join(f"Item {i}: a box of screws, aisle {i % 12}." for i in range(long))
    prompt = tokenizer(text)["input_ids"][:long]
    engine = await start(model_dir, threads, "--max-num-batched-tokens", str(budget), *extra)
    arrivals: list[float] = []
    long_done = asyncio.Event()
    # The stream's first gaps, alone, give its median at its first tokens.
    warmed = asyncio.Event()

    async def beside() -> None:
        # Long enough to outlast the long prompt's prefill, its last chunks included.
        ids = chat_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
        request = greedy(ids, STREAM_CONTEXT - len(ids))
        request["stop_conditions"]["ignore_eos"] = True
        async for _ in engine.generate(request, Context()):
            arrivals.append(time.perf_counter())
            if len(arrivals) >= 8:
                warmed.set()
            if long_done.is_set() and len(arrivals) >= ended + ALONE_AFTER:
                break

    ended = 0
    try:
        stream = asyncio.create_task(beside())
        # A stream that fails before it is warm raises here rather than leaving us waiting.
        warm = asyncio.create_task(warmed.wait())
        await asyncio.wait([stream, warm], return_when=asyncio.FIRST_COMPLETED)
        if stream.done():
            stream.result()
        started = len(arrivals)
        sent = time.perf_counter()
        first = 0.0
        # Then it decodes beside the stream: the stream's gaps with the long row in the batch.
        async for _ in engine.generate(greedy(prompt, LONG_DECODES), Context()):
            first = first or time.perf_counter()
        joined = bisect.bisect_right(arrivals, first)
        ended = len(arrivals)
        long_done.set()
        await stream
        # The same prompt with no stream beside it, its blocks no longer cached.
        await engine.engine_control("flush_cache", {})
        alone_ttft, _, _ = await timed(engine, greedy(prompt, 1))
    finally:
        await engine.cleanup()
    alone_first = median_of(gaps(arrivals[:started]))
    alone_last = median_of(gaps(arrivals[ended:]))
    prefilled = gaps(arrivals[started - 1 : joined])
    print(
        f"--max-num-batched-tokens {budget}, {len(prompt)}-token prompt beside a stream: "
        f"its TTFT {first - sent:.2f} s, alone {alone_ttft:.2f} s "
        f"({(first - sent) / alone_ttft:.1f}x); the stream's median gap alone "
        f"{alone_first * 1000:.0f} ms at its first tokens, {alone_last * 1000:.0f} ms once "
        f"the prompt has ended ({len(arrivals)} tokens); while the prompt is prefilled "
        f"{describe(prefilled, alone_last)}, longest over that median "
        f"{max(prefilled, default=0) / median_of(prefilled):.1f}x; while it decodes beside "
        f"{describe(gaps(arrivals[joined:ended]), alone_last)}; the gap as it left the batch "
        f"{gaps(arrivals[ended - 1 : ended + 1])[0] * 1000:.0f} ms, longest after "
        f"{max(gaps(arrivals[ended - 1 :])) * 1000:.0f} ms"
    )


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def median_of(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def describe(gaps: list[float], median: float) -> str:
    """The median and longest of ``gaps``, each over ``median`` (a gap alone)."""
    if not gaps:
        return "no gap (the stream had ended)"
    middle, longest = median_of(gaps), max(gaps)
    return (
        f"median {middle * 1000:.0f} ms ({middle / median:.1f}x), longest "
        f"{longest * 1000:.0f} ms ({longest / median:.1f}x)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--short", type=int, default=48)
    parser.add_argument("--long", type=int, default=8000)
    parser.add_argument("--budgets", default="2048,256")
    parser.add_argument("--decode-gap-ratio")
    parser.add_argument("--only", default="1,2,3,4,5")
    args = parser.parse_args()
    parts = {int(part) for part in args.only.split(",")}
    model_dir = await prepare_default_model(default_model_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if 1 in parts:
        await system_prompt_reuse(model_dir, tokenizer, args.threads)
    if 2 in parts:
        await shared_prompt(model_dir, tokenizer, args.threads)
    if 3 in parts:
        await decoding_at_once(model_dir, tokenizer, args.threads, args.requests, args.short)
    if 5 in parts:
        await next_turn(model_dir, tokenizer, args.threads)
    if 4 in parts:
        for budget in args.budgets.split(","):
            ratio = ("--decode-gap-ratio", args.decode_gap_ratio) if args.decode_gap_ratio else ()
            await gaps_beside_a_long_prompt(
                model_dir, tokenizer, args.threads, args.long, int(budget), *ratio
            )


if __name__ == "__main__":
    asyncio.run(main())
