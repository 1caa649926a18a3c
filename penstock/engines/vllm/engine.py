"""The ``vllm`` engine: vLLM's ``AsyncLLM`` in the gateway's process, behind the token
contract.

The gateway renders the chat template, tokenizes, detokenizes, matches stop strings and
parses tools and reasoning as for every engine; vLLM gets token ids and
``SamplingParams`` (:mod:`.sampling`) and streams token deltas back (:mod:`.outputs`).
Controls, weight updates and LoRA adapters are in :mod:`.controls`, :mod:`.weights` and
:mod:`.lora`. ``AsyncLLM`` runs the model in child processes of its own
(``VLLM::EngineCore`` and its workers, which carry Penstock's methods of
:mod:`.worker_extension`); this process keeps the gateway and vLLM's output handler.

Cancellation: ``generate`` may be cancelled at any ``await`` or closed at any ``yield``;
closing vLLM's stream aborts the request there. A request the gateway cancels (the
context's stop mark) is aborted at once and ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncGenerator
from typing import Any

from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    SUPPORTS_GUIDED_DECODING,
    SUPPORTS_PRIORITY,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    WorkerConfig,
)
from penstock.engines.controls import Body, ControlRejected, ControlTable, Handler, rejection
from penstock.engines.tasks import spawn_kept
from penstock.engines.vllm.args import parse_engine_args, served_name
from penstock.engines.vllm.controls import VllmControls
from penstock.engines.vllm.lora import VllmAdapters
from penstock.engines.vllm.metrics import statistics_text
from penstock.engines.vllm.outputs import ChoiceStream
from penstock.engines.vllm.pushes import PushedTensors
from penstock.engines.vllm.sampling import sampling_params
from penstock.engines.vllm.weights import VllmWeightUpdates

logger = logging.getLogger(__name__)


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError("token_ids is required and must be a non-empty list of token ids")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"token_ids: {token!r} is not a token id in [0, {vocab_size})")
    return value


def _priority(request: GenerateRequest) -> int:
    priority = request.get("priority", 0)  # type: ignore[misc]
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError("priority: must be an integer")
    return priority


class VllmEngine(VllmControls, VllmWeightUpdates, VllmAdapters, ControlTable, LLMEngine):
    """vLLM's ``AsyncLLM`` behind Penstock's engine contract."""

    def __init__(self, engine_args: Any) -> None:
        VllmControls.__init__(self)
        VllmAdapters.__init__(self)
        self.engine_args = engine_args
        self.pushed = PushedTensors(str(engine_args.model))
        self.llm: AsyncLLM | None = None
        self.on_cpu = bool(current_platform.is_cpu())
        self.context_length = 0
        self.vocab_size = 0
        # What the model's generation_config.json sets, as vLLM's server applies it.
        self.sampling_defaults: dict[str, Any] = {}
        self.compact_json = True
        self._in_flight: dict[str, Context] = {}
        self._aborts: set[asyncio.Task[Any]] = set()

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[VllmEngine, WorkerConfig]:
        engine_args = await parse_engine_args(sys.argv[1:] if argv is None else list(argv))
        served = served_name(engine_args) or str(engine_args.model)
        worker = WorkerConfig(
            namespace="penstock",
            model_name=str(engine_args.model),
            served_model_name=served,
            endpoint_types="chat,completions",
        )
        return cls(engine_args), worker

    async def start(self, worker_id: int) -> EngineConfig:
        # Builds the engine's processes and warms the model up: seconds to minutes.
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, self.engine_args)
        config = self.llm.vllm_config
        model_config = config.model_config
        self.context_length = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self.sampling_defaults = dict(model_config.get_diff_sampling_param())
        self.compact_json = bool(config.structured_outputs_config.disable_any_whitespace)
        scheduler = config.scheduler_config
        logger.info(
            "vllm engine ready: %s on %s, context %d, %d sequences",
            model_config.model,
            current_platform.device_type,
            self.context_length,
            scheduler.max_num_seqs,
        )
        return EngineConfig(
            model=served_name(self.engine_args) or str(model_config.model),
            runtime_data={
                CANCEL_SAFE_RUNTIME_KEY: True,
                SUPPORTS_GUIDED_DECODING: True,
                SUPPORTS_PRIORITY: scheduler.policy == "priority",
            },
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=config.cache_config.block_size,
                max_num_seqs=scheduler.max_num_seqs,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
            ),
        )

    async def cleanup(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        self.pushed.close()

    def _require_llm(self) -> AsyncLLM:
        if self.llm is None:
            raise RuntimeError("the vllm engine is not started")
        return self.llm

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        llm = self._require_llm()
        prompt_ids = _token_ids(request.get("token_ids"), self.vocab_size)
        params = sampling_params(
            request,
            prompt_len=len(prompt_ids),
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            defaults=self.sampling_defaults,
            compact_json=self.compact_json,
        )
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        salt = request.get("cache_salt")  # type: ignore[misc]
        if isinstance(salt, str) and salt:
            prompt["cache_salt"] = salt
        request_id = context.id()
        choice = ChoiceStream(len(prompt_ids), params.logprobs)
        stream = llm.generate(
            prompt,
            params,
            request_id,
            lora_request=self.lora_request(request.get("model")),
            priority=_priority(request),
        )
        watcher = asyncio.ensure_future(context.async_killed_or_stopped())
        watcher.add_done_callback(lambda done: self._abort_on_stop(done, request_id))
        self._in_flight[request_id] = context
        try:
            async for output in stream:
                yield choice.chunk(output, context.is_stopped() or context.is_killed())
        finally:
            watcher.cancel()
            self._in_flight.pop(request_id, None)
            await stream.aclose()

    def _abort_on_stop(self, watcher: asyncio.Future[Any], request_id: str) -> None:
        if watcher.cancelled() or self.llm is None:
            return
        spawn_kept(self._aborts, self.llm.abort(request_id))

    async def abort(self, context: Context) -> None:
        if self.llm is not None and context.id() in self._in_flight:
            await self.llm.abort(context.id())

    async def register_prometheus(self, metrics: Any) -> None:
        metrics.add_expfmt_callback(statistics_text)

    # -- controls and updates ---------------------------------------------------------------

    def control_handlers(self) -> dict[str, Handler]:
        return self.lifecycle_controls()

    def update_handlers(self) -> dict[str, Handler]:
        return {**self.weight_updates(), **self.lora_updates()}

    async def around_handler(self, name: str, handler: Handler, body: Body) -> Body:
        if self.llm is None:
            return rejection("the engine is not running")
        try:
            return await handler(body)
        except ControlRejected:
            raise
        except Exception as exc:
            logger.exception("engine call %s failed", name)
            return rejection(str(exc) or type(exc).__name__)
