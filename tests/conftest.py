"""Suite-wide settings (nothing may reach a model hub) and the in-process gateway fixtures:
``gateway`` (the sample engine, started) and ``client`` (an ASGI client for it)."""

from __future__ import annotations

import os

# Before any import that may read them (huggingface_hub reads them once, at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import signal
from collections.abc import AsyncIterator

import httpx
import pytest

from penstock.gateway import Gateway
from tests.support.inprocess import asgi_client, start_gateway

# A suite started in the background (``nohup``, ``&`` in a script) inherits SIGINT ignored,
# and so would every server it starts: Ctrl-C tests would then press a key nobody hears.
# Servers started from a terminal have it at its default, as they get once this process
# handles it (a handler, unlike "ignored", does not survive into a started program).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    started = await start_gateway()
    yield started
    await started.host.cleanup()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async for http in asgi_client(gateway):
        yield http
