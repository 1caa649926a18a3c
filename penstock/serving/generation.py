"""Engine chunks to per-choice OpenAI output: text, stops, logprobs, usage, weight versions.

This is the streaming hot path: plain data, no models, one pass per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from penstock.engines.context import Context
from penstock.errors import EngineError, OverloadedError, PenstockError
from penstock.metadata_upload import MetadataUploader
from penstock.preprocess.tool_calls import ParsedToolCall, ToolCallStream

if TYPE_CHECKING:
    from penstock.gateway import Gateway, ServedModel
    from penstock.preprocess import Preprocessor

# Engines say "cancelled"; clients of vLLM/SGLang (RL trainers among them) know "abort".
_FINISH_REASONS = {
    "stop": "stop",
    "eos": "stop",
    "length": "length",
    "cancelled": "abort",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
}

# (token_id, logprob, [(token_id, logprob), ...])
LogprobEntry = tuple[int, float, list[tuple[int, float]]]


class ChoiceState:
    """Everything one choice has produced so far."""

    __slots__ = (
        "detokenizer",
        "finish_reason",
        "index",
        "keep_text",
        "logprobs",
        "stop",
        "text_parts",
        "token_ids",
        "tool_calls",
        "tool_stream",
        "versions",
    )

    def __init__(
        self,
        index: int,
        preprocessor: Preprocessor | None,
        stops: list[str],
        *,
        keep_text: bool,
        want_logprobs: bool,
        parse_tool_calls: bool = False,
    ) -> None:
        self.index = index
        self.tool_stream = ToolCallStream() if parse_tool_calls else None
        self.tool_calls: list[ParsedToolCall] = []
        self.detokenizer = preprocessor.new_detokenizer() if preprocessor is not None else None
        if stops:
            from penstock.preprocess import StopStringMatcher

            self.stop: Any = StopStringMatcher(stops)
        else:
            self.stop = None
        self.keep_text = keep_text
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobEntry] | None = [] if want_logprobs else None
        self.finish_reason: str | None = None
        self.versions: list[tuple[str | None, int]] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def weight_version_segments(self) -> list[dict[str, Any]]:
        """Which weights produced which tokens: ``[{"weight_version", "start_token"}]``."""
        return [
            {"weight_version": version, "start_token": start} for version, start in self.versions
        ]

    def consume(
        self, chunk: dict[str, Any], version: str | None
    ) -> tuple[str, list[int], list[LogprobEntry] | None, str | None]:
        """Fold one engine chunk in; return (new text, new token ids, logprobs, finish)."""
        token_ids: list[int] = chunk.get("token_ids") or []
        if not self.versions or self.versions[-1][0] != version:
            self.versions.append((version, len(self.token_ids)))
        self.token_ids.extend(token_ids)
        text = ""
        if self.detokenizer is not None:
            step = self.detokenizer.step
            for token in token_ids:
                text += step(token)
        reason = chunk.get("finish_reason")
        if reason and self.detokenizer is not None:
            text += self.detokenizer.flush()
        if self.stop is not None:
            text, matched = self.stop.feed(text)
            if matched:
                reason = "stop"
            elif reason:
                text += self.stop.flush()
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
            if reason:
                tail, self.tool_calls = self.tool_stream.finish()
                text += tail
                if self.tool_calls:
                    reason = "tool_calls"
        entries = None
        if self.logprobs is not None and "log_probs" in chunk:
            entries = _logprob_entries(token_ids, chunk)
            self.logprobs.extend(entries)
        if reason:
            self.finish_reason = _FINISH_REASONS.get(reason, reason)
        if self.keep_text and text:
            self.text_parts.append(text)
        return text, token_ids, entries, self.finish_reason


def _logprob_entries(token_ids: list[int], chunk: dict[str, Any]) -> list[LogprobEntry]:
    values = chunk.get("log_probs") or []
    tops = chunk.get("top_logprobs") or []
    entries: list[LogprobEntry] = []
    for position, token in enumerate(token_ids):
        logprob = values[position] if position < len(values) else float("-inf")
        alternatives = tops[position] if position < len(tops) else []
        entries.append(
            (token, logprob, [(alt["token_id"], alt["logprob"]) for alt in alternatives or []])
        )
    return entries


class Generation:
    """One engine request: drives ``host.generate`` and keeps per-choice state and usage."""

    def __init__(
        self,
        gateway: Gateway,
        model: ServedModel,
        request: dict[str, Any],
        context: Context,
        *,
        stops: list[str],
        keep_text: bool,
        want_logprobs: bool,
        endpoint: str,
        streaming: bool,
        index_offset: int = 0,
        parse_tool_calls: bool = False,
    ) -> None:
        self.gateway = gateway
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
                keep_text=keep_text,
                want_logprobs=want_logprobs,
                parse_tool_calls=parse_tool_calls,
            )
            for i in range(n)
        ]
        self.prompt_tokens = len(request["token_ids"])
        self.cached_tokens: int | None = None
        self.weight_version: str | None = gateway.weight_version

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    async def deltas(
        self,
    ) -> AsyncIterator[
        tuple[ChoiceState, str, list[int], list[LogprobEntry] | None, str | None, str | None]
    ]:
        """Yield ``(choice, text, token_ids, logprobs, finish_reason, weight_version)``.

        Ends once every choice has finished. A stop string ends its choice at the gateway;
        when all choices are done that way the engine request is cancelled.
        """
        pending = len(self.choices)
        choices = self.choices
        families = self.gateway.metrics
        metrics = families.for_model(self.model.name)
        metrics.active.inc()
        metrics.queued.inc()
        started = last = time.perf_counter()
        first_token = True
        status, error_type = "error", "internal"
        stream = self.model.host.generate(self.request, self.context)
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
                text, token_ids, logprobs, finish = choice.consume(chunk, self.weight_version)
                if token_ids:
                    now = time.perf_counter()
                    if first_token:
                        first_token = False
                        metrics.queued.dec()
                        metrics.ttft.observe(now - started)
                        metrics.input_tokens.observe(self.prompt_tokens)
                    else:
                        metrics.itl.observe((now - last) / len(token_ids))
                    last = now
                    metrics.output_tokens_total.inc(len(token_ids))
                if finish is not None:
                    pending -= 1
                    self._record_usage(chunk)
                yield choice, text, token_ids, logprobs, finish, self.weight_version
                if pending == 0:
                    status, error_type = "success", ""
                    return
        except (asyncio.CancelledError, GeneratorExit):
            error_type = "cancelled"
            raise
        except OverloadedError:
            error_type = "overload"
            raise
        except PenstockError as exc:
            error_type = "validation" if exc.status_code < 500 else "internal"
            raise
        finally:
            if first_token:
                metrics.queued.dec()
            metrics.active.dec()
            metrics.duration.observe(time.perf_counter() - started)
            metrics.output_tokens.observe(self.completion_tokens)
            families.requests.labels(
                self.model.name,
                self.endpoint,
                "stream" if self.streaming else "unary",
                status,
                error_type,
            ).inc()
            if pending:
                self.model.host.cancel(self.context)
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

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
                record["logprobs"] = [logprob for _, logprob, _ in choice.logprobs]
            try:
                await uploader.upload_choice(choice.index, record)
            except Exception as exc:
                raise EngineError(f"metadata upload to {uploader.url} failed: {exc}") from exc

    def _record_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("completion_usage")
        if not usage:
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if isinstance(cached, int):
            self.cached_tokens = cached


async def merge(
    streams: list[AsyncIterator[Any]],
) -> AsyncIterator[Any]:
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
