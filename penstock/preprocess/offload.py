"""Heavy preprocessing (chat template rendering, tokenizing, detokenizing) off the event loop.

A long prompt takes the tokenizer seconds; run on the event loop, that stalls every other
request, ``/live`` and every stream's next token. :class:`PreprocessPool` runs such work
on a few worker threads instead (the tokenizer's batch calls release the GIL, see
:data:`~penstock.preprocess.preprocessor.RELEASE_GIL_SIZE`). Small inputs stay on the
loop: handing work to a thread and back costs more than tokenizing a short prompt, and
that is what nearly every request sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# Inputs up to this many characters (or token ids) are handled on the event loop: with
# the sample tokenizer that is about 1 ms of work, several times a thread hand-off
# (see bench/README.md).
INLINE_SIZE = 2048


class PreprocessPool:
    """A bounded set of worker threads for preprocessing too big to run on the loop.

    The threads start on first use; requests beyond ``workers`` wait in the pool's queue,
    so at most ``workers`` tokenizations run at once, whatever the request rate.
    """

    def __init__(self, workers: int, inline_size: int = INLINE_SIZE) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.inline_size = inline_size
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``; on a worker thread when ``size`` is over the inline size.

        Cancelling the caller stops waiting at once; work already running on a thread
        finishes there and its result is dropped.
        """
        if size <= self.inline_size:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), partial(fn, *args, **kwargs))

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.workers, thread_name_prefix="penstock-preprocess"
            )
        return self._executor
