"""The event loop ``penstock serve`` runs on."""

from __future__ import annotations

import asyncio

import uvloop

from penstock.app.server import event_loop_factory


def test_auto_and_uvloop_run_on_uvloop() -> None:
    for kind in ("auto", "uvloop"):
        factory = event_loop_factory(kind)
        assert factory is not None
        with asyncio.Runner(loop_factory=factory) as runner:
            assert isinstance(runner.get_loop(), uvloop.Loop)


def test_asyncio_keeps_the_standard_loop() -> None:
    assert event_loop_factory("asyncio") is None
