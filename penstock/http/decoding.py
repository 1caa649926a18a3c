"""A response body's ``Content-Encoding`` undone in bounded steps.

Fetches ask for ``identity``, and the HTTP libraries' own decoding is off: a few hundred
bytes of ``gzip, gzip`` inflate to gigabytes in one call of a library decoder, before any
size limit sees a byte. A host that encodes anyway is decoded here, layer by layer, each
call to zlib making at most :data:`STEP` bytes, so the fetch's byte limit is checked on
the decoded bytes as they appear and a bomb is refused after ``limit + STEP`` of them. The
loop runs other work between steps. Only the encodings zlib knows are accepted.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from penstock.errors import HttpConnectionError

STEP = 64 * 1024
# Each layer is a zlib stream: gzip's header (wbits + 16) or a zlib header.
_WBITS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
_MAX_LAYERS = 3


def content_codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` header, in the order they were applied."""
    codings = [part.strip().lower() for part in (header or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    unknown = [c for c in codings if c not in _WBITS]
    if unknown:
        raise HttpConnectionError(
            f"the media host sent Content-Encoding '{unknown[0]}', which is not decoded "
            "(the fetch asks for identity)"
        )
    if len(codings) > _MAX_LAYERS:
        raise HttpConnectionError(
            f"the media host sent {len(codings)} Content-Encoding layers (at most {_MAX_LAYERS})"
        )
    return codings


async def _inflate(chunks: AsyncIterator[bytes], coding: str) -> AsyncIterator[bytes]:
    decoder = zlib.decompressobj(_WBITS[coding])
    async for chunk in chunks:
        data = chunk
        # A full step may leave output inside zlib even when no input is left.
        while not decoder.eof:
            try:
                out = decoder.decompress(data, STEP)
            except zlib.error as exc:
                raise HttpConnectionError(f"the media body is not valid {coding}: {exc}") from exc
            data = decoder.unconsumed_tail
            if out:
                yield out
                await asyncio.sleep(0)
            if not data and len(out) < STEP:
                break
    if not decoder.eof:
        raise HttpConnectionError(f"the media body ends inside its {coding} stream")


def decoded_chunks(chunks: AsyncIterator[bytes], header: str | None) -> AsyncIterator[bytes]:
    """``chunks`` with the codings ``header`` names undone, outermost first."""
    for coding in reversed(content_codings(header)):
        chunks = _inflate(chunks, coding)
    return chunks
