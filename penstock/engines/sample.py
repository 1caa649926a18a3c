"""``sample``: a token engine that needs no model, for trying the gateway and testing it.

It emits a deterministic rotation of ordinary (non-special) token ids of a real tokenizer,
so the whole token pipeline (detokenization, stop strings, logprobs, usage) runs for real.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from penstock.engines.context import Context
from penstock.engines.contract import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    WorkerConfig,
)
from penstock.engines.health import (
    bos_token_id_or,
    build_health_check_payload,
    parse_health_check_payload_cli,
)

SAMPLE_TOKENIZER_DIR = Path(__file__).parent / "assets" / "sample-tokenizer"
MAX_TOP_LOGPROBS = 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="penstock serve --engine sample --",
        description="Sample token engine: rotating token ids, no model weights.",
    )
    parser.add_argument("--model", "--model-name", dest="model", default="sample-model")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--tokenizer",
        default=str(SAMPLE_TOKENIZER_DIR),
        help="folder with tokenizer.json and a chat template (default: the shipped one)",
    )
    parser.add_argument("--delay", type=float, default=0.01, help="seconds before each token")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens when none asked")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--endpoint-types", default="chat,completions")
    parser.add_argument("--health-check-payload", default=None)
    return parser


class SampleLLMEngine(LLMEngine):
    """Emits ``max_tokens`` tokens per choice, ``delay`` seconds apart."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer_dir: Path,
        delay: float = 0.01,
        max_tokens: int = 16,
        context_length: int = 2048,
    ) -> None:
        if delay < 0:
            raise ValueError("--delay must be >= 0")
        if max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.delay = delay
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.vocab_size = 0
        self.ordinary_ids: list[int] = []
        self.bos_token_id = 1
        self.started = False
        self.cleanups = 0
        self.aborted: list[str] = []

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[SampleLLMEngine, WorkerConfig]:
        args = _parser().parse_args(argv)
        tokenizer_dir = Path(args.tokenizer)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            _parser().error(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        engine = cls(
            args.model,
            tokenizer_dir=tokenizer_dir,
            delay=args.delay,
            max_tokens=args.max_tokens,
            context_length=args.context_length,
        )
        config = WorkerConfig(
            namespace="penstock",
            component="sample",
            model_name=str(tokenizer_dir),
            served_model_name=args.served_model_name or args.model,
            endpoint_types=args.endpoint_types,
            health_check_payload=parse_health_check_payload_cli(args.health_check_payload),
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        tokenizer = Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Only ids that decode to whole characters on their own, so every emitted token is
        # visible text (raw byte tokens of a byte-level BPE are UTF-8 fragments).
        self.ordinary_ids = [
            i
            for i in range(self.vocab_size)
            if i not in special_ids and "\ufffd" not in (text := tokenizer.decode([i])) and text
        ]
        self.bos_token_id = bos_token_id_or(tokenizer, default=min(special_ids, default=0))
        self.started = True
        return EngineConfig(
            model=self.model,
            served_model_name=self.model,
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=16,
                total_kv_blocks=1000,
                max_num_seqs=64,
                max_num_batched_tokens=self.context_length,
            ),
        )

    def token_at(self, step: int, choice: int) -> int:
        return self.ordinary_ids[(step + choice) % len(self.ordinary_ids)]

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        prompt_len = len(request.get("token_ids") or [])
        stop = request.get("stop_conditions") or {}
        sampling = request.get("sampling_options") or {}
        output = request.get("output_options") or {}
        max_new = stop.get("max_tokens") or self.max_tokens
        n = sampling.get("n") or 1
        logprobs = output.get("logprobs")
        top_k = min(int(logprobs), MAX_TOP_LOGPROBS) if logprobs is not None else None
        for step in range(max_new):
            if self.delay:
                await asyncio.sleep(self.delay)
            else:
                await asyncio.sleep(0)
            if context.is_stopped():
                for choice in range(n):
                    yield self._terminal(choice, [], "cancelled", prompt_len, step)
                return
            for choice in range(n):
                token = self.token_at(step, choice)
                chunk: GenerateChunk = {"token_ids": [token], "index": choice}
                if top_k is not None:
                    self._add_logprobs(chunk, token, top_k)
                if step == max_new - 1:
                    chunk["finish_reason"] = "length"
                    chunk["completion_usage"] = _usage(prompt_len, max_new)
                yield chunk

    def _add_logprobs(self, chunk: GenerateChunk, token: int, top_k: int) -> None:
        selected = -0.1 * (token % 10)
        chunk["log_probs"] = [selected]
        if top_k:
            alternatives = [{"rank": 1, "token_id": token, "logprob": selected}]
            for rank in range(2, top_k + 1):
                alternatives.append(
                    {
                        "rank": rank,
                        "token_id": (token + rank) % self.vocab_size,
                        "logprob": selected - 0.1 * rank,
                    }
                )
            chunk["top_logprobs"] = [alternatives]

    @staticmethod
    def _terminal(
        index: int, tokens: list[int], reason: str, prompt_len: int, produced: int
    ) -> GenerateChunk:
        return {
            "token_ids": tokens,
            "index": index,
            "finish_reason": reason,
            "completion_usage": _usage(prompt_len, produced),
        }

    async def abort(self, context: Context) -> None:
        self.aborted.append(context.id())

    async def health_check_payload(self) -> dict[str, Any] | None:
        return build_health_check_payload(self.bos_token_id)

    async def cleanup(self) -> None:
        if self.started:
            self.cleanups += 1
        self.started = False


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
