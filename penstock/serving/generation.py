"""One engine request: drives ``host.generate``, feeds each choice, keeps its usage.

Its per-request metrics are recorded by :class:`~penstock.serving.request_metrics.RequestRecorder`.

Completions with several prompts run one :class:`Generation` per prompt and interleave
their deltas with :func:`merge`; chat runs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

from penstock.engines.context import Context
from penstock.engines.contract import GenerateRequest
from penstock.errors import EngineError, MetadataUploadError
from penstock.metadata_upload import MetadataUploader
from penstock.serving.choice import ChoiceState, Delta
from penstock.serving.deadline import Deadline
from penstock.serving.request_metrics import FLUSH_EVERY, RequestRecorder
from penstock.tracing import active as active_tracing

if TYPE_CHECKING:
    from penstock.gateway import Gateway, ServedModel

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Generation:
    """One engine request: drives ``host.generate`` and keeps per-choice state and usage."""

    __slots__ = (
        "cached_tokens",
        "choices",
        "context",
        "deadline",
        "endpoint",
        "gateway",
        "model",
        "prompt_logprobs",
        "prompt_tokens",
        "request",
        "routed_experts",
        "streaming",
        "weight_version",
    )

    def __init__(
        self,
        gateway: Gateway,
        model: ServedModel,
        request: GenerateRequest,
        context: Context,
        *,
        stops: list[str],
        keep_text: bool,
        want_logprobs: bool,
        endpoint: str,
        streaming: bool,
        index_offset: int = 0,
        parse_tool_calls: bool = False,
        deadline: Deadline | None = None,
    ) -> None:
        self.gateway = gateway
        self.deadline = deadline
        self.endpoint = endpoint
        self.streaming = streaming
        self.model = model
        self.request = request
        self.context = context
        n = request["sampling_options"].get("n", 1)
        self.choices = [
            ChoiceState(
                index_offset + i,
                model.preprocessor,
                stops,
                prompt_token_ids=request["token_ids"],
                keep_text=keep_text,
                want_logprobs=want_logprobs,
                parse_tool_calls=parse_tool_calls,
                skip_special_tokens=request["output_options"].get("skip_special_tokens", True),
                include_stop=request["stop_conditions"].get("include_stop_str_in_output", False),
                stop_token_ids=request["stop_conditions"].get("stop_token_ids"),
            )
            for i in range(n)
        ]
        self.prompt_tokens = len(request["token_ids"])
        self.cached_tokens: int | None = None
        # The engine's prompt logprobs, when the request asked for them (see the contract's
        # SUPPORTS_PROMPT_LOGPROBS).
        self.prompt_logprobs: list[Any] | None = None
        # Per choice index, the experts its tokens were routed to, when the request asked
        # (see the contract's SUPPORTS_ROUTED_EXPERTS).
        self.routed_experts: dict[int, list[Any]] = {}
        self.weight_version: str | None = gateway.weight_version

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield what each engine chunk added to its choice.

        Ends once every choice has finished. A stop string ends its choice at the gateway;
        when all choices are done that way the engine request is cancelled.
        """
        pending = len(self.choices)
        choices = self.choices
        recorder = RequestRecorder(self.gateway.metrics, self.model.name, self.prompt_tokens)
        # The recorder's per-token counts, kept here between its flushes: this loop runs
        # for every chunk, and a call per chunk costs more than these few lines.
        last: float | None = None
        itl: list[float] = []
        unflushed = 0
        stream = self.model.host.generate(self.request, self.context)  # type: ignore[arg-type]
        tracing = active_tracing()
        if tracing is not None:
            stream = tracing.engine_call(stream, self)
        try:
            async for chunk in stream:
                choice = choices[chunk.get("index", 0)]
                if choice.finish_reason is not None:
                    continue
                engine_data = chunk.get("engine_data")
                if engine_data and "weight_version" in engine_data:
                    self.weight_version = engine_data["weight_version"]
                if chunk.get("finish_reason") == "error":
                    raise EngineError(chunk.get("error") or "the engine reported an error")
                if "prompt_logprobs" in chunk or "routed_experts" in chunk:
                    self._keep_reports(chunk)
                delta = choice.consume(chunk, self.weight_version)
                count = len(delta.token_ids)
                if count:
                    now = perf_counter()
                    if last is None:
                        recorder.first_token(now)
                    else:
                        itl.append((now - last) / count)
                    last = now
                    unflushed += count
                    if unflushed >= FLUSH_EVERY:
                        recorder.flush(itl, unflushed)
                        unflushed = 0
                if delta.finish_reason is not None:
                    pending -= 1
                    self._record_usage(chunk)
                yield delta
                if pending == 0:
                    recorder.succeeded()
                    return
        except BaseException as exc:
            recorder.failed(exc, self.deadline)
            raise
        finally:
            recorder.finish(
                itl,
                unflushed,
                self.completion_tokens,
                self.endpoint,
                self.streaming,
                [choice.finish_reason for choice in choices],
            )
            self._count_version_tokens()
            if pending:
                self.model.host.cancel(self.context)
            # try/except, not contextlib.suppress: once a request, it costs three calls less.
            try:
                await stream.aclose()  # type: ignore[attr-defined]
            except Exception:
                logger.debug(
                    "closing the engine stream of %s failed", self.context.id(), exc_info=True
                )
            # The access line's usage keeps this object until the connection's cycle is
            # collected: decoded media must not wait for that to leave the media budget.
            self.request.pop("multi_modal_data", None)

    def _keep_reports(self, chunk: dict[str, Any]) -> None:
        """What the engine reports beside the tokens: prompt logprobs, routed experts."""
        if "prompt_logprobs" in chunk:
            self.prompt_logprobs = chunk["prompt_logprobs"]
        if "routed_experts" in chunk:
            self.routed_experts[chunk.get("index", 0)] = chunk["routed_experts"]

    async def upload_metadata(self, uploader: MetadataUploader | None) -> None:
        """Write each choice's rollout record where the request asked (``nvext``)."""
        if uploader is None:
            return
        for choice in self.choices:
            record: dict[str, Any] = {
                "prompt_token_ids": self.request["token_ids"],
                "token_ids": choice.token_ids,
                "finish_reason": choice.finish_reason,
                "weight_versions": choice.weight_version_segments(),
            }
            if choice.logprobs is not None:
                record["logprobs"] = [entry.logprob for entry in choice.logprobs]
            try:
                await uploader.upload_choice(choice.index, record)
            except Exception as exc:
                # Where it went and why it failed is the operator's business, not the client's.
                logger.error(
                    "metadata upload of request %s, choice %d, to %s failed",
                    self.context.id(),
                    choice.index,
                    uploader.url,
                    exc_info=True,
                )
                raise MetadataUploadError() from exc

    def _count_version_tokens(self) -> None:
        """Credit each weight version with the tokens it produced (once per request)."""
        produced: dict[str | None, int] = {}
        for choice in self.choices:
            segments = choice.versions
            if not segments:
                # Ended before its first token (shed, cancelled): nothing to credit.
                continue
            ends = [segment.start_token for segment in segments[1:]] + [len(choice.token_ids)]
            for segment, end in zip(segments, ends, strict=True):
                if end > segment.start_token:
                    version = segment.weight_version
                    produced[version] = produced.get(version, 0) + end - segment.start_token
        for version, tokens in produced.items():
            self.gateway.metrics.count_version_tokens(self.model.name, version, tokens)

    def _record_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("completion_usage")
        if not usage:
            return
        reported = usage.get("prompt_tokens")
        # The engine's count wins: it includes what it expanded the prompt into (image
        # feature tokens of a vision-language model), which the gateway never sees.
        if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0:
            self.prompt_tokens = reported
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if isinstance(cached, int):
            self.cached_tokens = cached


def usage(generations: Sequence[Generation]) -> dict[str, Any]:
    """OpenAI ``usage`` over the engine requests that make one response."""
    prompt = sum(generation.prompt_tokens for generation in generations)
    completion = sum(generation.completion_tokens for generation in generations)
    total: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = [g.cached_tokens for g in generations if g.cached_tokens is not None]
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return total


async def merge(streams: list[AsyncIterator[T]]) -> AsyncGenerator[T, None]:
    """Interleave several async iterators as items arrive (batched completion prompts)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    finished = object()

    async def pump(position: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item, None))
        except Exception as exc:  # re-raised in the consumer
            await queue.put((position, finished, exc))
            return
        await queue.put((position, finished, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            _, item, error = await queue.get()
            if error is not None:
                raise error
            if item is finished:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
