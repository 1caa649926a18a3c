"""A value initialised at most once, safely across threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OnceLock(Generic[T]):
    """Holds one lazily built value.

    A raising initializer leaves the lock empty, so a transient failure (e.g. no network
    credentials yet) is retried on the next call rather than cached.
    """

    def __init__(self) -> None:
        self._value: T | None = None
        self._set = False
        self._lock = threading.Lock()

    def get(self) -> T | None:
        return self._value if self._set else None

    def get_or_init(self, initializer: Callable[[], T]) -> T:
        if self._set:
            return self._value  # type: ignore[return-value]
        with self._lock:
            if not self._set:
                self._value = initializer()
                self._set = True
        return self._value  # type: ignore[return-value]
