"""The CPU engine against transformers' own ``generate`` and llama.cpp, in one process.

Loads SmolLM2-135M-Instruct (the default model) once for ``generate`` (float32, greedy)
and starts the transformers engine once per ``--cpu-weight-dtype`` asked for (float32,
bfloat16, gguf: the default model's default, int8). With ``--llama-cpp`` (needs the
``bench`` extra: ``pip install -e ".[bench]"``) llama.cpp also loads the GGUF Penstock
converts the default model from (Q4_1, the same weights), greedy. ``--activations
float32,bfloat16`` starts each of those engines once per ``--cpu-activation-dtype`` too
(bfloat16: lossy, rows rounded to bfloat16 before the linears). Each round times, in
turn, ``generate`` and llama.cpp at concurrency 1 and every engine at concurrency 1 and
16, every run the same prompt and token count. Last, per
engine: how many prompts' greedy tokens equal ``generate``'s, and the teacher-forced top-1
agreement with the float32 model over ``generate``'s continuations (the next token each
model picks at every position of the same text).

    .venv/bin/python bench/cpu_decode.py [--rounds 3] [--tokens 64] [--threads N]
        [--llama-threads N] [--weights float32,bfloat16,int8] [--activations float32]
        [--llama-cpp]

Each side runs on its own default thread count unless told: the engine and ``generate``
on torch's (every core), llama.cpp on llama-cpp-python's (half the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.smollm2 import QUESTIONS
from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import default_gguf, prepare_default_model


def hf_generate(model: object, prompt: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def llama_cpp_threads() -> int:
    """llama-cpp-python's default ``n_threads``: half the cores."""
    return max((os.cpu_count() or 1) // 2, 1)


def llama_cpp_model(threads: int) -> object:
    from llama_cpp import Llama

    path = default_gguf(default_model_cache_dir())
    # Prompts too run on ``threads``: the batch default is every core, whose threads spin
    # against other work on a shared machine (c1 at load ~3: 27 tokens/s, 69 with this).
    return Llama(
        model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
    )


def llama_cpp_rate(model: object, prompt: list[int], tokens: int) -> float:
    """tokens/s of greedy tokens after ``prompt`` (its own KV cache reset first).

    ``generate`` yields until told to stop, end of text included: like ``ignore_eos``.
    """
    model.reset()  # type: ignore[attr-defined]
    started = time.perf_counter()
    produced = 0
    for _ in model.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):  # type: ignore[attr-defined]
        produced += 1
        if produced == tokens:
            break
    return produced / (time.perf_counter() - started)


async def engine_tokens(engine: TransformersEngine, prompt: list[int], tokens: int) -> list[int]:
    # min_tokens as generate's min_new_tokens: the end token is masked on both sides, where
    # ignore_eos alone would let the engine pick it and differ from generate there.
    request = {
        "token_ids": prompt,
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True},
    }
    out: list[int] = []
    async for chunk in engine.generate(request, Context()):
        out += chunk["token_ids"]
    return out


async def engine_rate(
    engine: TransformersEngine, prompts: list[list[int]], tokens: int, concurrency: int
) -> float:
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    started = time.perf_counter()
    results = await asyncio.gather(*(engine_tokens(engine, p, tokens) for p in batch))
    return sum(len(r) for r in results) / (time.perf_counter() - started)


def chunked_logits(model: object, ids: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``model``'s logits over ``ids``, ``chunk`` positions a pass: the CPU kernels (and
    their bfloat16 activations) take calls of at most 64 rows, longer ones compute in
    float32, so one pass over a whole text would not measure them."""
    cache, logits = None, []
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True)  # type: ignore[operator]
        cache = out.cache
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def top1_agreement(
    reference: object, engine: TransformersEngine, texts: list[tuple[list[int], list[int]]]
) -> float:
    """Share of positions where the engine's model picks the float32 model's next token."""
    agree = total = 0
    assert engine.scheduler is not None
    with torch.inference_mode(), engine.scheduler.step_lock:
        for prompt, continuation in texts:
            ids = torch.tensor([prompt + continuation])
            span = slice(len(prompt) - 1, ids.shape[1] - 1)
            wanted = reference(input_ids=ids).logits[0, span].argmax(-1)  # type: ignore[operator]
            got = chunked_logits(engine.model, ids)[0, span].argmax(-1)
            agree += int((wanted == got).sum())
            total += wanted.numel()
    return agree / total


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-threads", type=int, default=llama_cpp_threads())
    parser.add_argument(
        "--weights", default="float32,bfloat16,int8", help="--cpu-weight-dtype values to run"
    )
    parser.add_argument(
        "--activations", default="float32", help="--cpu-activation-dtype values to run"
    )
    parser.add_argument("--llama-cpp", action="store_true", help="time llama.cpp too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = await prepare_default_model(default_model_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    common = ["--cpu-threads", str(args.threads), "--max-num-seqs", "16"]
    engines: dict[str, TransformersEngine] = {}
    for dtype in args.weights.split(","):
        for activations in args.activations.split(","):
            label = f"{dtype} weights" + ("" if activations == "float32" else f", {activations} x")
            engine, _ = await TransformersEngine.from_args(
                [*common, "--cpu-weight-dtype", dtype, "--cpu-activation-dtype", activations]
            )
            await engine.start(0)
            await engine_tokens(engine, prompts[0], 4)
            engines[label] = engine
    hf_generate(reference, prompts[0], 4)
    llama = llama_cpp_model(args.llama_threads) if args.llama_cpp else None
    if llama is not None:
        llama_cpp_rate(llama, prompts[0], 4)
    rates: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds):
            prompt = prompts[round_ % len(prompts)]
            started = time.perf_counter()
            hf_generate(reference, prompt, args.tokens)
            rates.setdefault("generate, c1", []).append(
                args.tokens / (time.perf_counter() - started)
            )
            if llama is not None:
                rate = llama_cpp_rate(llama, prompt, args.tokens)
                rates.setdefault("llama.cpp Q4_1, c1", []).append(rate)
            for label, engine in engines.items():
                for c in (1, 16):
                    rate = await engine_rate(
                        engine, [prompt] if c == 1 else prompts, args.tokens, c
                    )
                    rates.setdefault(f"engine {label}, c{c}", []).append(rate)
            print(f"round {round_ + 1}, load average {os.getloadavg()[0]:.1f}", flush=True)
        llama_threads = f", llama.cpp {args.llama_threads}" if llama is not None else ""
        print(
            f"\nthreads {args.threads}{llama_threads}, {args.tokens} tokens, "
            "tokens/s (median of rounds):"
        )
        base = statistics.median(rates["generate, c1"])
        llama_base = statistics.median(rates.get("llama.cpp Q4_1, c1", [0.0]))
        for label, values in rates.items():
            median = statistics.median(values)
            runs = ", ".join(f"{v:.1f}" for v in values)
            against = f"  {median / llama_base:5.2f}x llama.cpp" if llama_base else ""
            print(f"  {label:<36} {median:7.1f}  {median / base:5.2f}x generate{against}  [{runs}]")
        texts = [(prompt, hf_generate(reference, prompt, args.tokens)) for prompt in prompts]
        for label, engine in engines.items():
            equal = 0
            for prompt, expected in texts:
                got = await engine_tokens(engine, prompt, args.tokens)
                if got == expected:
                    equal += 1
                else:
                    same = next(
                        i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b
                    )
                    print(f"  {label}: differs from generate at token {same}")
            agreement = top1_agreement(reference, engine, texts)
            print(
                f"{label}: greedy tokens equal to generate's on {equal}/{len(texts)} prompts, "
                f"teacher-forced top-1 agreement with float32 {100 * agreement:.1f}%"
            )
    finally:
        for engine in engines.values():
            await engine.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
