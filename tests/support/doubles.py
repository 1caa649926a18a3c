"""Engine test doubles for faults that a real engine can't be made to show on demand."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    WorkerConfig,
)
from penstock.engines.samples.engine import SampleLLMEngine


class MarkedSampleEngine(SampleLLMEngine):
    """The sample engine, recording start and cleanup in a file the test reads."""

    marker: Path

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--marker", required=True)
        own, rest = parser.parse_known_args(argv)
        engine, config = await SampleLLMEngine.from_args(rest)
        engine.__class__ = cls
        engine.marker = Path(own.marker)
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        with self.marker.open("a") as f:
            f.write("start\n")
        return config

    async def cleanup(self) -> None:
        await super().cleanup()
        with self.marker.open("a") as f:
            f.write("cleanup\n")


class ModelCacheRecordingEngine(SampleLLMEngine):
    """The sample engine, writing the ``PENSTOCK_MODEL_CACHE`` it was built under to
    ``--record``."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--record", required=True)
        own, rest = parser.parse_known_args(argv)
        seen = os.environ.get("PENSTOCK_MODEL_CACHE", "")
        await asyncio.to_thread(Path(own.record).write_text, seen)
        return await SampleLLMEngine.from_args(rest)


class ScriptedEngine(LLMEngine):
    """Yields whatever ``script(request)`` says; records lifecycle calls."""

    def __init__(self, fail_start: bool = False, start_delay: float = 0.0) -> None:
        self.fail_start = fail_start
        self.start_delay = start_delay
        self.calls: list[str] = []
        self.aborted: list[str] = []
        self.partial_resource: object | None = None
        self.canary: dict[str, Any] | None = None
        self.requests: list[dict[str, Any]] = []

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[ScriptedEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="test")

    async def start(self, worker_id: int) -> EngineConfig:
        self.calls.append(f"start:{worker_id}")
        self.partial_resource = object()
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        if self.fail_start:
            raise RuntimeError("weights not found")
        return EngineConfig(model="scripted")

    async def cleanup(self) -> None:
        self.calls.append("cleanup")
        self.partial_resource = None

    async def abort(self, context: Context) -> None:
        self.aborted.append(context.id())

    async def health_check_payload(self) -> dict[str, Any] | None:
        return self.canary

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.requests.append(dict(request))
        mode = request.get("extra_args", {}).get("mode", "ok")
        if mode == "raise_first":
            raise RuntimeError("secret internal detail")
        if mode == "raise_value":
            raise ValueError("temperature must be positive")
        yield {"token_ids": [5], "index": 0}
        if mode == "raise_late":
            raise RuntimeError("device lost")
        if mode == "no_terminal":
            return
        if mode == "slow":
            for _ in range(1000):
                if context.is_stopped():
                    yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
                    return
                await asyncio.sleep(0.01)
                yield {"token_ids": [6], "index": 0}
        if mode == "hang":
            await asyncio.sleep(3600)
        yield {"token_ids": [7], "index": 0, "finish_reason": "length"}
        if mode == "after_terminal":
            yield {"token_ids": [8], "index": 0}


class CancelSafeScriptedEngine(ScriptedEngine):
    """A :class:`ScriptedEngine` that advertises ``CANCEL_SAFE_RUNTIME_KEY``: the host
    drives it from its consumer's task."""

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        config.runtime_data = {CANCEL_SAFE_RUNTIME_KEY: True}
        return config


class FailingStartEngine(MarkedSampleEngine):
    """Allocates something in start, then fails; cleanup must still run."""

    async def start(self, worker_id: int) -> EngineConfig:
        with self.marker.open("a") as f:
            f.write("start\n")
        raise RuntimeError("checkpoint /nowhere is unreadable")


class NotAnEngine:
    pass


class AbortRecordingEngine(MarkedSampleEngine):
    """The sample engine writing each emitted step and each abort to the marker file."""

    async def start(self, worker_id: int) -> EngineConfig:
        return await SampleLLMEngine.start(self, worker_id)

    def token_at(self, step: int, *rest: int) -> int:
        with self.marker.open("a") as f:
            f.write(f"token {step}\n")
        return super().token_at(step, *rest)

    async def abort(self, context: Context) -> None:
        await super().abort(context)
        with self.marker.open("a") as f:
            f.write(f"abort {context.id()}\n")


class ReplyEngine(SampleLLMEngine):
    """Answers every request with the tokens of one fixed text (``--reply``), then stops."""

    reply_ids: list[int]

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--reply", required=True)
        # The parsers the engine declares, as Dynamo's workers take them.
        parser.add_argument("--dyn-tool-call-parser", default=None)
        parser.add_argument("--dyn-reasoning-parser", default=None)
        own, rest = parser.parse_known_args(argv)
        engine, config = await SampleLLMEngine.from_args(rest)
        engine.__class__ = cls
        engine.reply = own.reply
        config.tool_call_parser = own.dyn_tool_call_parser
        config.reasoning_parser = own.dyn_reasoning_parser
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        from tokenizers import Tokenizer

        config = await super().start(worker_id)
        tokenizer = Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        self.reply_ids = tokenizer.encode(self.reply).ids
        return config

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        prompt = len(request.get("token_ids") or [])
        for i, token in enumerate(self.reply_ids):
            await asyncio.sleep(0)
            chunk: GenerateChunk = {"token_ids": [token], "index": 0}
            if i == len(self.reply_ids) - 1:
                chunk["finish_reason"] = "stop"
                chunk["completion_usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": i + 1,
                    "total_tokens": prompt + i + 1,
                }
            yield chunk


class CapableEngine(SampleLLMEngine):
    """Advertises image input and output constraints; replies with what it was handed."""

    async def start(self, worker_id: int) -> EngineConfig:
        from tokenizers import Tokenizer

        config = await super().start(worker_id)
        config.runtime_data = {"supports_image_input": True, "supports_guided_decoding": True}
        self.tokenizer = Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        return config

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        import json

        seen = {
            "image_sizes": [
                list(item["Decoded"].size)
                for item in (request.get("multi_modal_data") or {}).get("image_url", [])
            ],
            "guided_decoding": request["sampling_options"].get("guided_decoding"),
        }
        ids = self.tokenizer.encode(json.dumps(seen)).ids
        yield {"token_ids": ids, "index": 0, "finish_reason": "stop"}


class FleetUpdateFailingEngine(SampleLLMEngine):
    """The sample engine refusing weight updates on the Ray Serve replica whose name is in
    the ``--fail-on`` file (absent or empty: every replica accepts them)."""

    fail_on: Path

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--fail-on", required=True)
        own, rest = parser.parse_known_args(argv)
        engine, config = await SampleLLMEngine.from_args(rest)
        engine.__class__ = cls
        engine.fail_on = Path(own.fail_on)
        return engine, config

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        from penstock.ray.replica import replica_name

        named = self.fail_on.read_text().strip() if self.fail_on.exists() else ""
        if update.startswith("update_weights_") and named == replica_name():
            return {"status": "error", "message": "refused on purpose: the test named this replica"}
        return await super().engine_update(update, body)
