"""The operations served on Penstock's own request path rather than FastAPI's.

Each is declared on its router as an ordinary FastAPI route ``(body, request)``, so the
OpenAPI document lists it with its request model, but :class:`penstock.app.hot.HotRoutes`
answers it: it matches the method and path exactly, checks the inference key, reads the
body with :func:`penstock.schemas.json_body.read_json_body`, validates it into the
route's body model and calls the endpoint, with FastAPI's errors and envelopes. FastAPI's
own parser, dependencies and exception handlers never run for these operations; every
other method or spelling of their paths (405, the trailing-slash redirect) still reaches
FastAPI. Why: FastAPI's request machinery was about half of the server's CPU for a short
request (``bench/README.md``).
"""

from __future__ import annotations

from fastapi import APIRouter

from penstock.routers import chat, completions, generate, tokenize

HOT_OPERATIONS = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
        ("PUT", "/generate"),
        # Not for speed: their bodies are then read by the one JSON body reader.
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    }
)

HOT_ROUTERS: tuple[APIRouter, ...] = (
    chat.router,
    completions.router,
    generate.router,
    tokenize.router,
)
"""The routers that declare the operations of :data:`HOT_OPERATIONS`."""
