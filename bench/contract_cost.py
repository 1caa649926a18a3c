"""What one engine request costs in-process, layer by layer, from the engine's chunks up.

Each row is one request run to its end, sequentially in this process (no HTTP, no
client), CPU time per request, median of ``--rounds`` (the rows take turns within each
round). One event-loop turn per token, as the sample engine at ``--delay 0`` and the
benchmarks' raw apps make:

- ``loop turns``: the turns alone, what any token stream costs at least;
- ``+ detokenize``: the turns and the incremental detokenizer primed with the prompt,
  the per-token work of ``work_floor.py``;
- ``minimal engine``: a contract engine doing nothing but yield one chunk dict a token;
- ``+ EngineHost``: that engine through ``EngineHost.generate`` (admission, the contract's
  per-chunk rules);
- ``+ ChoiceState``: each of those chunks folded into its choice (detokenizer, stop
  strings, weight versions);
- ``+ Generation``: ``Generation.deltas``, what the serving layer runs (metrics, usage);
- ``sample engine``: ``--engine sample``'s own stream, read directly (prefix cache, KV
  events, the admin plane's pause checks).

With 16 and 64 tokens, the per-token cost and the fixed one are the line through the two.

    .venv/bin/python bench/contract_cost.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import types
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any

import uvloop

from penstock.app.server import build_gateway, freeze_imported_heap
from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    EngineConfig,
    LLMEngine,
    WorkerConfig,
)
from penstock.engines.host import EngineHost
from penstock.engines.loading import load_engine_class
from penstock.gateway import Gateway, ServedModel
from penstock.serving.choice import ChoiceState
from penstock.serving.generation import Generation
from penstock.settings import Settings

TOKEN_COUNTS = (1, 16, 64)
ROWS = (
    "loop turns",
    "+ detokenize",
    "minimal engine",
    "+ EngineHost",
    "+ ChoiceState",
    "+ Generation",
    "sample engine",
)


@types.coroutine
def _loop_turn() -> Generator[None, None, None]:
    yield


class MinimalEngine(LLMEngine):
    """Tokens out of nothing: one loop turn and one chunk a token, the last with its
    finish reason. Cancel-safe, as the sample and transformers engines are."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[MinimalEngine, WorkerConfig]:
        raise NotImplementedError("built by contract_cost.py")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="minimal", runtime_data={CANCEL_SAFE_RUNTIME_KEY: True})

    async def cleanup(self) -> None:
        pass

    async def generate(
        self, request: dict[str, Any], context: Context
    ) -> AsyncGenerator[dict[str, Any], None]:
        count = request["stop_conditions"]["max_tokens"]
        token_ids = self.token_ids
        for step in range(count):
            await _loop_turn()
            chunk: dict[str, Any] = {"token_ids": [token_ids[step % len(token_ids)]], "index": 0}
            if step == count - 1:
                chunk["finish_reason"] = "length"
            yield chunk


def _requests(model: ServedModel, tokens: int, count: int) -> list[dict[str, Any]]:
    """Engine requests for new prompts (a number in each), as the HTTP benchmarks send."""
    preprocessor = model.preprocessor
    assert preprocessor is not None
    requests = []
    for number in range(count):
        messages = [{"role": "user", "content": f"Tell me story number {number}."}]
        requests.append(
            {
                "token_ids": preprocessor.encode(preprocessor.render_chat(messages)),
                "stop_conditions": {"max_tokens": tokens},
                "sampling_options": {"n": 1},
                "output_options": {},
                "model": model.name,
            }
        )
    return requests


def _runs(
    gateway: Gateway, sample: ServedModel, minimal: ServedModel, next_request: Callable[[], Any]
) -> dict[str, Callable[[], Awaitable[None]]]:
    """Each row's request, as a coroutine function."""
    preprocessor = sample.preprocessor
    assert preprocessor is not None
    engine = minimal.host.engine
    assert isinstance(engine, MinimalEngine)
    token_ids = engine.token_ids

    async def loop_turns() -> None:
        for _ in range(next_request()["stop_conditions"]["max_tokens"]):
            await _loop_turn()

    async def detokenize() -> None:
        request = next_request()
        detokenizer = preprocessor.new_detokenizer(request["token_ids"])
        pieces = []
        for step in range(request["stop_conditions"]["max_tokens"]):
            await _loop_turn()
            pieces.append(detokenizer.step(token_ids[step % len(token_ids)]))
        pieces.append(detokenizer.flush())

    async def minimal_engine() -> None:
        async for _ in engine.generate(next_request(), Context("bench")):
            pass

    async def hosted() -> None:
        async for _ in minimal.host.generate(next_request(), Context("bench")):
            pass

    async def folded() -> None:
        request = next_request()
        choice = ChoiceState(
            0,
            preprocessor,
            [],
            prompt_token_ids=request["token_ids"],
            keep_text=True,
            want_logprobs=False,
        )
        async for chunk in minimal.host.generate(request, Context("bench")):
            choice.consume(chunk, None)

    async def generation() -> None:
        run = Generation(
            gateway,
            minimal,
            next_request(),
            Context("bench"),
            stops=[],
            keep_text=True,
            want_logprobs=False,
            endpoint="chat_completions",
            streaming=False,
        )
        async for _ in run.deltas():
            pass

    async def sample_engine() -> None:
        async for _ in sample.host.engine.generate(next_request(), Context("bench")):  # type: ignore[attr-defined]
            pass

    functions = (loop_turns, detokenize, minimal_engine, hosted, folded, generation, sample_engine)
    return dict(zip(ROWS, functions, strict=True))


async def _measure(tokens: int, rounds: int, per_round: int) -> dict[str, float]:
    settings = Settings(engine="sample", engine_args=["--delay", "0", "--max-tokens", "16"])
    # As `penstock serve` does: no garbage-collector pass walks the imported modules.
    load_engine_class(settings.engine)
    freeze_imported_heap()
    gateway = await build_gateway(settings)
    sample = gateway.resolve("sample-model")
    engine = MinimalEngine(sample.host.engine.ordinary_ids)  # type: ignore[attr-defined]
    host = EngineHost(engine, WorkerConfig(namespace="bench"))
    await host.start()
    minimal = dataclasses.replace(sample, host=host)
    warmup = 20
    requests = _requests(sample, tokens, len(ROWS) * rounds * (per_round + warmup))
    runs = _runs(gateway, sample, minimal, iter(requests).__next__)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    try:
        for _ in range(rounds):
            for row, run in runs.items():
                for _ in range(warmup):
                    await run()
                started = time.process_time()
                for _ in range(per_round):
                    await run()
                times[row].append((time.process_time() - started) / per_round * 1e6)
    finally:
        await host.cleanup()
        await gateway.host.cleanup()
    return {row: statistics.median(values) for row, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="requests a row a round")
    args = parser.parse_args()
    results = {
        tokens: uvloop.run(_measure(tokens, args.rounds, args.requests)) for tokens in TOKEN_COUNTS
    }
    header = "".join(f"{f'{tokens} tokens':>11s}" for tokens in TOKEN_COUNTS)
    print(f"CPU us per request, in-process{'':4s}{header}  per token  fixed")
    for row in ROWS:
        figures = "".join(f"{results[tokens][row]:11.1f}" for tokens in TOKEN_COUNTS)
        per_token = (results[64][row] - results[16][row]) / 48
        fixed = results[16][row] - 16 * per_token
        print(f"  {row:32s}{figures}  {per_token:9.2f}  {fixed:5.1f}")


if __name__ == "__main__":
    main()
