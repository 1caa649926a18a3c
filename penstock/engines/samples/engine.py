"""``sample``: a token engine that needs no model, for trying the gateway and testing it.

It emits a deterministic rotation of ordinary (non-special) token ids of a real tokenizer,
so the whole token pipeline (detokenization, stop strings, logprobs, usage) runs for real.

It also implements the RL admin controls in a simulated but observable way: pause, sleep,
wake, abort and flush in :mod:`.controls`; weights (one ``token_shift`` tensor),
their updates, checks and rollback in :mod:`.weights`; the prefix cache, KV events
and simulated forward passes in :mod:`.telemetry`. Every chunk carries
``engine_data: {"weight_version": v}``. ``--token-budget N`` advertises a ``TokenBudget``
of ``N`` tokens that the gateway enforces.

* **LoRA**: an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``
  holding ``token_shift``) adds its shift for requests whose ``model`` names it.
* **media input**: ``--image-input`` / ``--audio-input`` advertise ``supports_image_input``
  / ``supports_audio_input``; the reply then starts with what the gateway handed over,
  ``[image WxH]`` per image and ``[audio S.SSs RATEHz]`` per clip (one token per step,
  within ``max_tokens``), before the usual rotation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import types
from collections.abc import AsyncGenerator, Generator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from penstock.engines.builtin_options import SAMPLE
from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    MULTI_CHOICE_RUNTIME_KEY,
    SUPPORTS_AUDIO_INPUT,
    SUPPORTS_IMAGE_INPUT,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    WorkerConfig,
)
from penstock.engines.controls import GET_WEIGHT_VERSION, Body, ControlTable, Handler
from penstock.engines.engine_options import engine_parser
from penstock.engines.health import (
    bos_token_id_or,
    build_health_check_payload,
    is_probe,
    parse_health_check_payload_cli,
)
from penstock.engines.samples.controls import Flight, Hold, SampleLifecycleControls
from penstock.engines.samples.telemetry import (
    KV_BLOCK_SIZE,
    TOTAL_KV_BLOCKS,
    PrefixCache,
    SampleTelemetry,
)
from penstock.engines.samples.weights import (
    SampleWeightControls,
    SampleWeights,
    load_sample_weights,
    write_sample_weights,
)
from penstock.engines.token_budget import TOKEN_BUDGET_RUNTIME_KEY, TokenBudget
from penstock.engines.weights.sync import NixlPuller

__all__ = [
    "KV_BLOCK_SIZE",
    "SAMPLE_TOKENIZER_DIR",
    "TOTAL_KV_BLOCKS",
    "PrefixCache",
    "SampleLLMEngine",
    "SampleWeights",
    "load_sample_weights",
    "write_sample_weights",
]

SAMPLE_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "sample-tokenizer"
MAX_TOP_LOGPROBS = 20


@types.coroutine
def _next_loop_turn() -> Generator[None, None, None]:
    """Give the event loop one turn, as ``asyncio.sleep(0)`` does, without a coroutine of
    its own: a token at ``--delay 0`` costs one call fewer."""
    yield


def _parser() -> argparse.ArgumentParser:
    return engine_parser(SAMPLE)


class SampleLLMEngine(
    SampleLifecycleControls, SampleWeightControls, SampleTelemetry, ControlTable, LLMEngine
):
    """Emits ``max_tokens`` tokens per choice, ``delay`` seconds apart."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer_dir: Path,
        delay: float = 0.01,
        max_tokens: int = 16,
        context_length: int = 2048,
        token_budget: int | None = None,
        image_input: bool = False,
        audio_input: bool = False,
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
        self.token_budget = (
            TokenBudget(token_budget, True, True) if token_budget is not None else None
        )
        self.image_input = image_input
        self.audio_input = audio_input
        self.tokenizer: Tokenizer | None = None
        self.vocab_size = 0
        self.ordinary_ids: list[int] = []
        self.bos_token_id = 1
        self.started = False
        self.aborted: list[str] = []
        self.weights = SampleWeights()
        self._engine_data: dict[str, Any] = {"weight_version": None}
        self.adapters: dict[str, SampleWeights] = {}
        SampleTelemetry.__init__(self)
        self._holds: dict[str, Hold] = {}
        self._flights: set[Flight] = set()
        self._changed: asyncio.Event | None = None
        self._passes: asyncio.Task[None] | None = None
        self._puller: NixlPuller | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[SampleLLMEngine, WorkerConfig]:
        args = _parser().parse_args(argv)
        tokenizer_dir = Path(args.tokenizer or SAMPLE_TOKENIZER_DIR)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            _parser().error(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        engine = cls(
            args.model,
            tokenizer_dir=tokenizer_dir,
            delay=args.delay,
            max_tokens=args.max_tokens,
            context_length=args.context_length,
            token_budget=args.token_budget,
            image_input=args.image_input,
            audio_input=args.audio_input,
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
        self.tokenizer = tokenizer
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
        self._passes = asyncio.get_running_loop().create_task(
            self._report_passes(), name="sample-forward-passes"
        )
        return EngineConfig(
            model=self.model,
            served_model_name=self.model,
            runtime_data={
                MULTI_CHOICE_RUNTIME_KEY: True,
                # generate ends cleanly when cancelled at an await or closed at a yield.
                CANCEL_SAFE_RUNTIME_KEY: True,
                SUPPORTS_IMAGE_INPUT: self.image_input,
                SUPPORTS_AUDIO_INPUT: self.audio_input,
                **(
                    {TOKEN_BUDGET_RUNTIME_KEY: self.token_budget.as_runtime_data()}
                    if self.token_budget is not None
                    else {}
                ),
            },
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=KV_BLOCK_SIZE,
                total_kv_blocks=TOTAL_KV_BLOCKS,
                max_num_seqs=64,
                max_num_batched_tokens=self.context_length,
            ),
        )

    def token_at(self, step: int, choice: int, shift: int = 0) -> int:
        return self.ordinary_ids[(step + choice + shift) % len(self.ordinary_ids)]

    def _media_report(self, request: GenerateRequest) -> list[int]:
        """The token ids of ``[image WxH]`` / ``[audio S.SSs RATEHz]`` per media item."""
        data = request.get("multi_modal_data") or {}
        if not data or self.tokenizer is None:
            return []
        words = []
        for item in data.get("image_url", []):
            width, height = item["Decoded"].size
            words.append(f"[image {width}x{height}]")
        for item in data.get("audio_url", []):
            waveform, rate = item["Decoded"]
            words.append(f"[audio {len(waveform) / rate:.2f}s {rate:g}Hz]")
        ids: list[int] = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        return ids

    @property
    def weight_version(self) -> str | None:
        return self._engine_data["weight_version"]

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        # One dict per version, shared by every chunk stamped with it (chunks are read, not
        # changed, downstream): a chunk costs no dict of its own.
        self._engine_data = {"weight_version": version}

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        prompt = request.get("token_ids") or []
        prompt_len = len(prompt)
        stop = request.get("stop_conditions") or {}
        sampling = request.get("sampling_options") or {}
        output = request.get("output_options") or {}
        max_new = stop.get("max_tokens") or self.max_tokens
        n = sampling.get("n") or 1
        logprobs = output.get("logprobs")
        top_k = min(int(logprobs), MAX_TOP_LOGPROBS) if logprobs is not None else None
        lead = self._media_report(request)
        # Canaries probe that the engine runs; a pause must not make it look dead.
        held = not is_probe(request)
        flight = Flight(context, prompt_len)
        if held:
            self._flights.add(flight)
            self._note_prompt(prompt)
        try:
            if held:
                await self._hold_while_blocked(flight)
            flight.admitted = True
            token_at = self.token_at
            # An adapter is the request's for its whole run; the base weights may change
            # under it (a weight update between two tokens shows from the next one).
            adapter = self.adapters.get(request.get("model") or "")
            adapter_shift = adapter.token_shift if adapter else 0
            for step in range(max_new):
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await _next_loop_turn()
                # Checked here first: a call per token costs more than the test.
                if held and self._holds:
                    await self._hold_while_blocked(flight)
                if flight.abort_reason is not None or context.is_stopped():
                    reason = flight.abort_reason or "cancelled"
                    for choice in range(n):
                        yield self._terminal(choice, [], reason, prompt_len, step)
                    return
                flight.generated += 1
                shift = self.weights.token_shift + adapter_shift
                for choice in range(n):
                    token = lead[step] if step < len(lead) else token_at(step, choice, shift)
                    chunk: GenerateChunk = {
                        "token_ids": [token],
                        "index": choice,
                        "engine_data": self._engine_data,
                    }
                    if top_k is not None:
                        self._add_logprobs(chunk, token, top_k)
                    if step == max_new - 1:
                        chunk["finish_reason"] = "length"
                        chunk["completion_usage"] = _usage(prompt_len, max_new)
                    yield chunk
        finally:
            if held:
                self._flights.discard(flight)
                self._notify()

    # -- controls ------------------------------------------------------------------------

    def control_handlers(self) -> dict[str, Handler]:
        return {
            **self.lifecycle_controls(),
            GET_WEIGHT_VERSION: self._get_weight_version,
            **self.weight_controls(),
        }

    def update_handlers(self) -> dict[str, Handler]:
        return self.weight_updates()

    async def _get_weight_version(self, body: Body) -> Body:
        return {"weight_version": self.weight_version}

    def _weights_changed(self) -> None:
        # Cached prefixes were computed by the old weights.
        self._clear_prefix_cache()

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
        self.started = False
        puller, self._puller = self._puller, None
        if puller is not None:
            puller.close()
        passes, self._passes = self._passes, None
        if passes is not None:
            passes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await passes


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
