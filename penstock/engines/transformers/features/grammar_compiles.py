"""Compiling output constraints off the event loop, each within a deadline, and each API
key one compile at a time.

A compile cannot be stopped once xgrammar runs it: one past its deadline answers its
request with a 400 naming the limit, and keeps its key's turn until it really ends, so a
key that sends costly constraints waits behind its own, never another key's. The key is
the digest the gateway puts in the request's context (``API_KEY_METADATA``), not its
cache salt, which a client may spell as it likes where keys share cached prefixes.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from penstock.engines.guided_specs import GuidedSpec
from penstock.engines.transformers.features.constraints import GrammarCompiler


class CompileQueue:
    """Runs :meth:`GrammarCompiler.compile` on its own threads, within ``deadline_s``."""

    def __init__(
        self, tokenizer_path: Path, vocab_size: int, end_ids: frozenset[int], deadline_s: float
    ) -> None:
        self._compiler = GrammarCompiler(tokenizer_path, vocab_size, end_ids)
        self._deadline_s = deadline_s
        self._threads = ThreadPoolExecutor(max(2, os.cpu_count() or 2), "grammar-compile")
        # Each key's turn, and how many of its requests hold or wait for it.
        self._turns: dict[str, asyncio.Lock] = {}
        self._waiting: Counter[str] = Counter()

    async def compile(self, spec: GuidedSpec, owner: str | None) -> Any:
        """The compiled grammar of ``spec`` for a request of the API key ``owner`` (its
        digest; None: no turn to wait for); ``ValueError`` when it cannot be compiled or
        does not compile within the deadline (the wait for its key's turn included)."""
        cached = self._compiler.cached(spec)
        if cached is not None:
            return cached
        # Loading the tokenizer's table is the server's cost, not the constraint's.
        await asyncio.wrap_future(self._threads.submit(self._compiler.prepare))
        try:
            compiling = self._compile_in_turn(spec, owner)
            return await asyncio.wait_for(compiling, self._deadline_s)
        except TimeoutError:
            raise ValueError(
                f"sampling_options.guided_decoding.{spec.kind} did not compile within "
                f"{self._deadline_s:g} s (the engine's --grammar-compile-timeout)"
            ) from None

    async def _compile_in_turn(self, spec: GuidedSpec, owner: str | None) -> Any:
        if owner is None:
            return await asyncio.wrap_future(self._threads.submit(self._compiler.compile, spec))
        turn = self._turns.setdefault(owner, asyncio.Lock())
        self._waiting[owner] += 1
        try:
            await turn.acquire()
        except BaseException:
            self._leave(owner)
            raise
        running = self._threads.submit(self._compiler.compile, spec)
        loop = asyncio.get_running_loop()
        # Released once the compile ends (or, still queued, is cancelled): not at the deadline.
        running.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, owner, turn))
        return await asyncio.wrap_future(running)

    def _release(self, owner: str, turn: asyncio.Lock) -> None:
        turn.release()
        self._leave(owner)

    def _leave(self, owner: str) -> None:
        self._waiting[owner] -= 1
        if not self._waiting[owner]:
            del self._waiting[owner], self._turns[owner]
