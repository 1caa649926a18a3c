"""Conformance kit: run an engine class through the contract's checks in one call.

``await run_conformance(EngineClass, argv)`` raises :class:`ConformanceError` naming the
first failed check. Checks (as the contract states them):

* ``start`` returns an EngineConfig with a non-empty ``model``;
* one ``generate`` ends in exactly one terminal per choice, and nothing follows it;
* concurrent ``generate`` calls interleave and all complete;
* a mid-stream cancel (``context.stop_generating()``) ends the stream within 2 s, with
  ``finish_reason == "cancelled"`` for token engines;
* an engine that advertises ``CANCEL_SAFE_RUNTIME_KEY``: a stream cancelled at an ``await``
  and one closed at a ``yield`` end at once (with ``abort`` after each), and the engine
  then completes a new request;
* the controls of :mod:`penstock.engines.controls` that the engine advertises answer as
  defined there: a body that is not an object is refused with ``{"status": "error",
  "message"}``; ``abort_request`` of an unknown id ends nothing, and ``abort_all`` ends a
  stream in flight (``finish_reason`` ``"abort"`` or ``"cancelled"`` for token engines);
  ``is_paused`` / ``is_sleeping`` answer booleans; a pause then a resume, and a sleep then
  a wake, answer ``paused`` / ``resumed`` and ``sleeping`` / ``awake``, and the engine
  then completes a new request;
* ``cleanup`` twice is safe, and ``cleanup`` without ``start`` is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from penstock.engines import controls
from penstock.engines.constants import ModelInput
from penstock.engines.context import Context
from penstock.engines.contract import CANCEL_SAFE_RUNTIME_KEY, model_input_of

CANCEL_DEADLINE_S = 2.0
# How long a check waits for a stream it expects to end before calling it stuck.
STUCK_AFTER_S = CANCEL_DEADLINE_S + 30


class ConformanceError(AssertionError):
    """An engine broke the contract; the message names the check."""


def default_request(raw: bool, max_tokens: int) -> dict[str, Any]:
    if raw:
        return {"prompt": "a red ball on a table", "n": 1, "response_format": "b64_json"}
    return {
        "token_ids": [1, 2, 3, 4],
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
    }


def _longest_allowed(config: Any) -> int:
    """A request long enough to still be running when it is cancelled, within the context."""
    context_length = getattr(getattr(config, "llm", None), "context_length", None)
    if not context_length:
        return 100_000
    return max(1, context_length - len(default_request(False, 1)["token_ids"]))


async def _collect(stream: AsyncIterator[dict[str, Any]], raw: bool) -> list[dict[str, Any]]:
    chunks = [chunk async for chunk in stream]
    if not chunks:
        raise ConformanceError("NoTerminalChunk: generate yielded nothing")
    if raw:
        return chunks
    terminals = [i for i, chunk in enumerate(chunks) if chunk.get("finish_reason")]
    if not terminals:
        raise ConformanceError("NoTerminalChunk: no chunk carried finish_reason")
    if len(terminals) > 1 or terminals[0] != len(chunks) - 1:
        raise ConformanceError("ChunkAfterTerminal: chunks followed the terminal")
    for chunk in chunks:
        if not isinstance(chunk.get("token_ids"), list) or not isinstance(chunk.get("index"), int):
            raise ConformanceError("InvalidChunk: every chunk needs token_ids and index")
    return chunks


async def _check_cancel(engine: Any, request: dict[str, Any], raw: bool) -> None:
    context = Context("conformance-cancel")
    stream = engine.generate(request, context)
    started = time.monotonic()
    terminal: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(STUCK_AFTER_S):
            first = await anext(stream)
            context.stop_generating()
            started = time.monotonic()
            terminal = first
            if raw or not first.get("finish_reason"):
                async for chunk in stream:
                    terminal = chunk
    except TimeoutError as exc:
        raise ConformanceError("CancellationNotObserved: stream never ended") from exc
    elapsed = time.monotonic() - started
    if elapsed > CANCEL_DEADLINE_S:
        raise ConformanceError(
            f"CancellationNotObserved: stream ended {elapsed:.2f}s after the cancel"
        )
    if not raw and (terminal is None or terminal.get("finish_reason") != "cancelled"):
        reason = terminal.get("finish_reason") if terminal else None
        raise ConformanceError(f"CancellationIgnored: terminal finish_reason was {reason!r}")


async def _check_cancel_safe(
    engine: Any, request: dict[str, Any], short: dict[str, Any], raw: bool
) -> None:
    try:
        async with asyncio.timeout(STUCK_AFTER_S):
            cancelled = Context("conformance-cancelled-at-await")
            stream = engine.generate(dict(request), cancelled)
            await anext(stream)
            waiting = asyncio.ensure_future(anext(stream))
            # One loop turn: the next chunk is being waited for inside the engine.
            await asyncio.sleep(0)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await waiting
            await stream.aclose()
            await engine.abort(cancelled)

            closed = Context("conformance-closed-at-yield")
            stream = engine.generate(dict(request), closed)
            await anext(stream)
            await stream.aclose()
            await engine.abort(closed)

            after = Context("conformance-after-cancels")
            await _collect(engine.generate(dict(short), after), raw)
    except ConformanceError:
        raise
    except TimeoutError as exc:
        raise ConformanceError("CancelSafeEngineStuck: no new request completed") from exc
    except Exception as exc:
        raise ConformanceError(f"CancelSafeCancelFailed: {exc!r}") from exc


def _expect(answer: Any, check: str, **fields: Any) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise ConformanceError(f"{check}: the answer is not an object: {answer!r}")
    wrong = {k: answer.get(k) for k, v in fields.items() if answer.get(k) != v}
    if wrong:
        raise ConformanceError(f"{check}: expected {fields}, got {answer!r}")
    return answer


async def _check_abort_all(engine: Any, long_request: dict[str, Any], raw: bool) -> None:
    stream = engine.generate(dict(long_request), Context("conformance-abort-all"))
    try:
        async with asyncio.timeout(STUCK_AFTER_S):
            first = await anext(stream)
            answer = _expect(
                await engine.engine_control(controls.ABORT_REQUEST, {"abort_all": True}),
                "AbortAllAnswer",
                status="ok",
            )
            if "conformance-abort-all" not in answer.get("aborted", []):
                raise ConformanceError(f"AbortAllMissedStream: {answer!r}")
            chunks = [first] + [chunk async for chunk in stream]
    except TimeoutError as exc:
        raise ConformanceError("AbortAllStuck: the stream did not end") from exc
    finally:
        await stream.aclose()
    reason = chunks[-1].get("finish_reason")
    if not raw and reason not in ("abort", "cancelled"):
        raise ConformanceError(f"AbortAllWrongReason: finish_reason {reason!r}")


async def _check_controls(
    engine: Any, short: dict[str, Any], long_request: dict[str, Any], raw: bool
) -> None:
    """The advertised controls answer with the shared bodies and shapes."""
    offered = engine.supported_controls()
    for name in sorted(offered & controls.CONTROL_NAMES):
        _expect(await engine.engine_control(name, ["not", "an", "object"]), name, status="error")
    if controls.ABORT_REQUEST in offered:
        unknown = {"request_id": "conformance-nobody"}
        _expect(
            await engine.engine_control(controls.ABORT_REQUEST, unknown),
            "AbortUnknownAnswer",
            status="ok",
            aborted=[],
        )
        await _check_abort_all(engine, long_request, raw)
    for query, field in ((controls.IS_PAUSED, "is_paused"), (controls.IS_SLEEPING, "is_sleeping")):
        if query in offered:
            _expect(await engine.engine_control(query, {}), f"{query}Answer", **{field: False})
    pairs = (
        (controls.PAUSE, {"mode": "abort"}, "paused", controls.RESUME, "resumed"),
        (controls.SLEEP, {"level": 0}, "sleeping", controls.WAKE_UP, "awake"),
    )
    for hold, body, held, release, released in pairs:
        if {hold, release} <= offered:
            _expect(await engine.engine_control(hold, body), hold, status=held)
            _expect(await engine.engine_control(release, {}), release, status=released)
            try:
                async with asyncio.timeout(STUCK_AFTER_S):
                    await _collect(engine.generate(dict(short), Context(f"after-{release}")), raw)
            except TimeoutError as exc:
                raise ConformanceError(f"NotServingAfter{release}: no request completed") from exc


async def run_conformance(
    engine_cls: type[Any],
    argv: list[str] | None = None,
    *,
    request: dict[str, Any] | None = None,
    long_request: dict[str, Any] | None = None,
) -> None:
    """Run every check on fresh instances of ``engine_cls`` built by ``from_args(argv)``."""
    argv = list(argv or [])
    unstarted, _ = await engine_cls.from_args(argv)
    try:
        await unstarted.cleanup()
    except Exception as exc:
        raise ConformanceError(f"CleanupWithoutStartFailed: {exc!r}") from exc

    engine, _ = await engine_cls.from_args(argv)
    config = await engine.start(1)
    try:
        if not getattr(config, "model", None):
            raise ConformanceError("EmptyModelInConfig: EngineConfig.model is empty")
        raw = model_input_of(engine) is ModelInput.Text
        short = request or default_request(raw, max_tokens=4)
        await _collect(engine.generate(dict(short), Context("conformance-one")), raw)

        results = await asyncio.gather(
            *(
                _collect(engine.generate(dict(short), Context(f"conformance-{i}")), raw)
                for i in range(4)
            ),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise ConformanceError(f"ConcurrentGenerateFailed: {failures[0]!r}")

        if long_request is None:
            long_request = default_request(raw, _longest_allowed(config))
        await _check_cancel(engine, dict(long_request), raw)
        if (config.runtime_data or {}).get(CANCEL_SAFE_RUNTIME_KEY) is True:
            await _check_cancel_safe(engine, long_request, short, raw)
        await _check_controls(engine, short, long_request, raw)
    finally:
        try:
            await engine.cleanup()
            await engine.cleanup()
        except Exception as exc:
            raise ConformanceError(f"SecondCleanupFailed: {exc!r}") from exc
