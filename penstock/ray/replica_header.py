"""The ``x-penstock-replica`` response header: which engine replica served the answer.

Under ``--ray`` the ingress picks a replica per stream (:mod:`penstock.ray.streams`);
:class:`ReplicaHeader`, an ASGI middleware around the routes, gives each HTTP request a
list in a context variable, :func:`note_replica` (called by the fleet host once the
replica is picked) adds the replica's name to it, and the response start carries the
names, in the order they were picked (several when a request's choices went to several
replicas). The list is shared, not the variable's value set anew, so a name noted in a
task the request started (one per choice, a deadline's) still reaches the header. The
engine's first output is awaited before a response starts (:mod:`penstock.serving.stream`),
so streamed answers carry the header too. A response no replica served (an error before
routing, ``/health``) has none.

A single process serves everything itself: the middleware is not installed there, so no
header is sent and its hot path pays nothing.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-penstock-replica"
_HEADER_NAME = REPLICA_HEADER.encode()

_SERVED_BY: ContextVar[list[str] | None] = ContextVar("penstock_served_by", default=None)


def note_replica(name: str) -> None:
    """Name ``name`` in the current HTTP response's header (outside a request: nothing)."""
    served = _SERVED_BY.get()
    if served is not None and name not in served:
        served.append(name)


class ReplicaHeader:
    """ASGI middleware: the response start names the replicas :func:`note_replica` noted."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served: list[str] = []
        token = _SERVED_BY.set(served)

        async def send_naming_replica(message: Message) -> None:
            if served and message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (_HEADER_NAME, ",".join(served).encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_naming_replica)
        finally:
            _SERVED_BY.reset(token)
