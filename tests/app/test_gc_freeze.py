"""``penstock serve`` freezes what it imported before the engine starts: full garbage
collection passes then skip those objects, and the engine's own stay collectable."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from penstock.app import server
from penstock.settings import Settings


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()


class _Stop(Exception):
    pass


async def test_serve_freezes_after_loading_the_engine_class_and_before_starting_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def load(name: str) -> Any:
        calls.append(f"load {name}")

    def freeze() -> None:
        calls.append("freeze")

    async def build(settings: Settings, **_: Any) -> Any:
        calls.append("start the engine")
        raise _Stop

    monkeypatch.setattr(server, "load_engine_class", load)
    monkeypatch.setattr(server, "freeze_imported_heap", freeze)
    monkeypatch.setattr(server, "build_gateway", build)
    with pytest.raises(_Stop):
        await server._serve(Settings(engine="sample", port=0))
    assert calls == ["load sample", "freeze", "start the engine"]


def test_what_exists_is_frozen_and_what_comes_later_stays_collectable(
    unfrozen_after: None,
) -> None:
    class Weights:
        cycle: Any = None

    server.freeze_imported_heap()
    assert gc.get_freeze_count() > 0
    weights = Weights()
    weights.cycle = weights
    dropped = weakref.ref(weights)
    del weights
    gc.collect()
    assert dropped() is None
