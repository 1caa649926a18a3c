"""Content-Encoding undone in bounded steps: a bomb never inflates past what is read."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

import pytest

from penstock.errors import HttpConnectionError
from penstock.http.decoding import STEP, content_codings, decoded_chunks
from tests.support.media_files import gzip


def deflate(data: bytes) -> bytes:
    return zlib.compress(data)


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def read(data: bytes, header: str | None, stop_after: int | None = None) -> list[bytes]:
    pieces: list[bytes] = []
    async for piece in decoded_chunks(chunks(data), header):
        pieces.append(piece)
        if stop_after is not None and sum(map(len, pieces)) > stop_after:
            break
    return pieces


async def test_layers_are_undone_outermost_first() -> None:
    body = b"image bytes " * 10_000
    assert b"".join(await read(gzip(deflate(body)), "deflate, gzip")) == body
    assert b"".join(await read(body, None)) == body
    assert b"".join(await read(body, "identity")) == body


async def test_a_bomb_is_read_in_steps_no_larger_than_the_step() -> None:
    bomb = gzip(gzip(bytes(16 * 1024 * 1024)))
    assert len(bomb) < 50_000
    pieces = await read(bomb, "gzip, gzip", stop_after=1024 * 1024)
    assert all(len(piece) <= STEP for piece in pieces)
    assert sum(map(len, pieces)) <= 1024 * 1024 + STEP


@pytest.mark.parametrize(
    ("header", "words"),
    [("br", "'br'"), ("gzip, zstd", "'zstd'"), ("gzip, gzip, gzip, gzip", "4 Content-Encoding")],
)
def test_unknown_or_too_many_codings_are_refused(header: str, words: str) -> None:
    with pytest.raises(HttpConnectionError, match=words):
        content_codings(header)


async def test_a_broken_or_cut_stream_is_a_connection_error() -> None:
    with pytest.raises(HttpConnectionError, match="not valid gzip"):
        await read(b"not gzip at all", "gzip")
    with pytest.raises(HttpConnectionError, match="ends inside"):
        await read(gzip(b"x" * 100_000)[:-20], "gzip")
